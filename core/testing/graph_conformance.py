"""Graph-replay conformance: capture a backend's decode in CUDA graphs at several batch sizes, then
replay random padded batches over many steps and compare with the backend's own eager output and
with torch_native. Needs CUDA; used by `attention_conformance.make_graph_suite`.
"""

from __future__ import annotations

import random

import torch

from backplane.attention.base import AttentionLayerInfo
from backplane.batch import ForwardBatch, ForwardMode
from backplane.graph_runner import StaticInputs, pad_into
from backplane.graph_sizes import GraphKey, padded_size
from backplane.testing.attention_conformance import TOLERANCE, Case, Harness

PAD_ROW_SEQ = 1


class DecodeWorld:
    """`num_reqs` requests with random cached lengths; each step decodes a random subset."""

    def __init__(self, num_reqs: int, max_len: int, dtype, seed: int):
        case = Case("graph", "decode", tuple([max_len] * num_reqs), (1,) * num_reqs, num_heads=8, num_kv_heads=2)
        self.h = Harness(case, dtype, "cuda", seed)
        self.rng = random.Random(seed)
        self.cached = [self.rng.randint(1, max_len - 40) for _ in range(num_reqs)]
        self.pad_row = self.h.req_pool.alloc()  # an all-zero row: padded requests read slot 0
        self.h.req_pool.req_to_token[self.pad_row].zero_()

    def step_batch(self, bs: int) -> ForwardBatch:
        reqs = self.rng.sample(range(len(self.cached)), bs)
        rows = [self.h.rows[r] for r in reqs]
        seq = [self.cached[r] + 1 for r in reqs]
        locs = torch.tensor([int(self.h.req_pool.req_to_token[row, s - 1]) for row, s in zip(rows, seq)])
        for r in reqs:
            self.cached[r] += 1
        dev = self.h.device
        return ForwardBatch(ForwardMode.DECODE, bs, torch.zeros(bs, dtype=torch.int64, device=dev),
                            torch.tensor([s - 1 for s in seq], device=dev), torch.tensor(rows, device=dev),
                            torch.tensor(seq, dtype=torch.int32, device=dev), torch.tensor(seq, dtype=torch.int32),
                            locs.to(dev), self.h.req_pool, self.h.kv_pool)


def check_graph_replay(spec, dtype=torch.bfloat16, sizes=(1, 2, 4, 8, 16), steps: int = 24, seed: int = 0) -> float:
    """Returns the worst |graph - eager| seen; raises AssertionError on a mismatch."""
    from backplane.attention.torch_native import TorchNativeAttnBackend

    world = DecodeWorld(num_reqs=max(sizes) + 3, max_len=300, dtype=dtype, seed=seed)
    layer: AttentionLayerInfo = world.h.layer()
    backend = spec.factory(world.h.context())
    reference = TorchNativeAttnBackend(world.h.context())
    max_bs = max(sizes)
    backend.init_graph_state(max_bs, max_bs)
    static = StaticInputs.allocate(max_bs, max_bs, "cuda")
    q = torch.zeros(max_bs, layer.num_heads, layer.head_dim, dtype=dtype, device="cuda")
    kv = torch.zeros(2, max_bs, layer.num_kv_heads, layer.head_dim, dtype=dtype, device="cuda")
    graphs, outs = {}, {}
    for bs in sorted(sizes, reverse=True):
        key = GraphKey(ForwardMode.DECODE, bs, 1)
        batch = pad_into(static, world.step_batch(1), key, world.pad_row, spec.seq_len_fill_value)
        backend.init_metadata_for_capture(key, batch)
        for _ in range(2):
            backend.forward(q[:bs], kv[0, :bs], kv[1, :bs], layer, batch)
        torch.cuda.synchronize()
        graphs[key] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[key]):
            outs[key] = backend.forward(q[:bs], kv[0, :bs], kv[1, :bs], layer, batch)
    worst, rng = 0.0, random.Random(seed)
    for _ in range(steps):
        real = world.step_batch(rng.randint(1, max_bs))
        key = GraphKey(ForwardMode.DECODE, padded_size(real.batch_size, sorted(sizes)), 1)
        n = real.batch_size
        new_q, new_k, new_v = (world.h.randn(n, layer.num_heads, layer.head_dim),
                               world.h.randn(n, layer.num_kv_heads, layer.head_dim),
                               world.h.randn(n, layer.num_kv_heads, layer.head_dim))
        padded = pad_into(static, real, key, world.pad_row, spec.seq_len_fill_value)
        q[:n].copy_(new_q)
        kv[0, :n].copy_(new_k)
        kv[1, :n].copy_(new_v)
        backend.init_metadata_for_replay(key, padded)
        graphs[key].replay()
        got = outs[key][:n].float().clone()
        reference.init_forward_metadata(real)
        want = reference.forward(new_q, new_k, new_v, layer, real).float()
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(got, want, atol=tol, rtol=tol,
                                   msg=lambda m: f"graph replay at batch {n} (padded to {key.batch_size}): {m}")
        worst = max(worst, float((got - want).abs().max()))
    return worst
