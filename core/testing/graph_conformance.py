"""Graph-replay conformance: capture a backend's decode (or a DRAFT_EXTEND of the same number of
tokens in every request, as an EAGLE draft window) in CUDA graphs at several batch sizes, then
replay random padded batches over many steps and compare with torch_native. Needs CUDA; used by
`attention_conformance.make_graph_suite`.

The compile case (`check_compiled_decode`, any device): decode through the core's opaque op
`torch.ops.backplane.attention` inside a `torch.compile(fullgraph=True, dynamic=True)` region, as
`--enable-torch-compile` runs it, over random batch sizes; equal to torch_native.
"""

from __future__ import annotations

import random

import torch

from backplane.contracts.attention import AttentionLayerInfo
from backplane.contracts.batch import ForwardBatch, ForwardMode
from backplane.executor.graph_runner import StaticInputs, capture_graph, pad_into
from backplane.executor.graph_sizes import GraphKey, padded_size
from backplane.models.base import ModelContext
from backplane.testing.attention_harness import TOLERANCE, Case, Harness

PAD_ROW_SEQ = 1


class DecodeWorld:
    """`num_reqs` requests with random cached lengths; each step runs `tokens` new tokens of a
    random subset (one: DECODE; more: a DRAFT_EXTEND without extend lengths, causal)."""

    def __init__(self, num_reqs: int, max_len: int, dtype, seed: int, device: str = "cuda"):
        case = Case("graph", "decode", tuple([max_len] * num_reqs), (1,) * num_reqs, num_heads=8, num_kv_heads=2)
        self.h = Harness(case, dtype, device, seed)
        self.rng, self.max_len = random.Random(seed), max_len
        self.cached = [self.rng.randint(1, max_len - 40) for _ in range(num_reqs)]
        self.pad_row = self.h.req_pool.alloc()  # an all-zero row: padded requests read slot 0
        self.h.req_pool.req_to_token[self.pad_row].zero_()

    def step_batch(self, bs: int, tokens: int = 1) -> ForwardBatch:
        reqs = self.rng.sample(range(len(self.cached)), bs)
        for r in reqs:  # keep every position inside the placed prefix
            if self.cached[r] + tokens >= self.max_len:
                self.cached[r] = self.rng.randint(1, self.max_len // 2)
        rows = [self.h.rows[r] for r in reqs]
        seq = [self.cached[r] + tokens for r in reqs]
        positions = [p for s in seq for p in range(s - tokens, s)]
        r2t = self.h.req_pool.req_to_token.cpu()
        locs = torch.tensor([int(r2t[row, p]) for row, s in zip(rows, seq) for p in range(s - tokens, s)])
        for r in reqs:
            self.cached[r] += tokens
        dev = self.h.device
        mode = ForwardMode.DECODE if tokens == 1 else ForwardMode.DRAFT_EXTEND
        return ForwardBatch(forward_mode=mode, batch_size=bs, input_ids=torch.zeros(bs * tokens, dtype=torch.int64, device=dev),
                            positions=torch.tensor(positions, device=dev), req_pool_indices=torch.tensor(rows, device=dev),
                            seq_lens=torch.tensor(seq, dtype=torch.int32, device=dev),
                            seq_lens_cpu=torch.tensor(seq, dtype=torch.int32), out_cache_loc=locs.to(dev),
                            req_to_token_pool=self.h.req_pool, token_to_kv_pool=self.h.kv_pool)


def check_graph_replay(spec, dtype=torch.bfloat16, sizes=(1, 2, 4, 8, 16), steps: int = 24, seed: int = 0,
                       tokens: int = 1) -> float:
    """Returns the worst |graph - torch_native| seen; raises AssertionError on a mismatch.

    tokens: new tokens per request (1: DECODE graphs; more: uniform DRAFT_EXTEND graphs)."""
    from backplane.attention.torch_native import TorchNativeAttnBackend

    world = DecodeWorld(num_reqs=max(sizes) + 3, max_len=300, dtype=dtype, seed=seed)
    layer: AttentionLayerInfo = world.h.layer()
    backend = spec.factory(world.h.context())
    reference = TorchNativeAttnBackend(world.h.context())
    max_bs, T = max(sizes), tokens
    mode = ForwardMode.DECODE if T == 1 else ForwardMode.DRAFT_EXTEND
    fill = max(spec.seq_len_fill_value, T)  # a padded request holds its T tokens
    backend.init_graph_state(max_bs, max_bs * T)
    static = StaticInputs.allocate(max_bs, max_bs * T, "cuda")
    q = torch.zeros(max_bs * T, layer.num_heads, layer.head_dim, dtype=dtype, device="cuda")
    kv = torch.zeros(2, max_bs * T, layer.num_kv_heads, layer.head_dim, dtype=dtype, device="cuda")
    graphs, outs = {}, {}
    for bs in sorted(sizes, reverse=True):
        key = GraphKey(mode, bs, T)
        batch = pad_into(static, world.step_batch(1, T), key, world.pad_row, fill)
        backend.init_metadata_for_capture(key, batch)
        n = bs * T
        graphs[key], outs[key] = capture_graph(lambda n=n, batch=batch: backend.forward(
            q[:n], kv[0, :n], kv[1, :n], layer, batch))
    worst, rng = 0.0, random.Random(seed)
    for _ in range(steps):
        real = world.step_batch(rng.randint(1, max_bs), T)
        key = GraphKey(mode, padded_size(real.batch_size, sorted(sizes)), T)
        n = real.num_tokens
        new_q, new_k, new_v = (world.h.randn(n, layer.num_heads, layer.head_dim),
                               world.h.randn(n, layer.num_kv_heads, layer.head_dim),
                               world.h.randn(n, layer.num_kv_heads, layer.head_dim))
        padded = pad_into(static, real, key, world.pad_row, fill)
        q[:n].copy_(new_q)
        kv[0, :n].copy_(new_k)
        kv[1, :n].copy_(new_v)
        backend.init_metadata_for_replay(key, padded)
        graphs[key].replay()
        got = outs[key][:n].float().clone()
        reference.init_forward_metadata(real)
        want = reference.forward(new_q, new_k, new_v, layer, real).float()
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=lambda m, real=real, key=key: (
            f"{mode.value} graph replay at batch {real.batch_size} (padded to {key.batch_size}): {m}"))
        worst = max(worst, float((got - want).abs().max()))
    return worst


class _OpaqueLayer:
    """What torch.ops.backplane.attention looks up by handle: `ctx.attn_backend` and `info`."""

    def __init__(self, backend, info: AttentionLayerInfo):
        self.ctx, self.info = ModelContext(attn_backend=backend), info


def check_compiled_decode(spec, dtype=torch.bfloat16, device: str = "cuda", steps: int = 8, seed: int = 0,
                          max_bs: int = 9) -> float:
    """Decode through the opaque attention op in one compiled region (fullgraph: a graph break
    fails), over `steps` random batches of 1..max_bs requests, against torch_native eagerly.
    Returns the worst |compiled - torch_native|; raises AssertionError on a mismatch."""
    from backplane.attention.torch_native import TorchNativeAttnBackend
    from backplane.ops import opaque

    world = DecodeWorld(num_reqs=max_bs + 3, max_len=200, dtype=dtype, seed=seed, device=device)
    layer = world.h.layer()
    backend, reference = spec.factory(world.h.context()), TorchNativeAttnBackend(world.h.context())
    holder = _OpaqueLayer(backend, layer)  # kept alive: the op's handle table holds weak references
    handle = opaque.register_layer(holder)

    def body(q, k, v):
        # q: [T, H, D]; the scaling around the op is what Inductor fuses; the op stays one call.
        out = torch.empty_like(q)
        torch.ops.backplane.attention(q * 1.0, k, v, out, handle)
        return out * 1.0

    compiled = torch.compile(body, fullgraph=True, dynamic=True)
    worst, rng = 0.0, random.Random(seed)
    for _ in range(steps):
        real = world.step_batch(rng.randint(1, max_bs))
        n = real.num_tokens
        q, k, v = (world.h.randn(n, layer.num_heads, layer.head_dim), world.h.randn(n, layer.num_kv_heads, layer.head_dim),
                   world.h.randn(n, layer.num_kv_heads, layer.head_dim))
        backend.init_forward_metadata(real)  # planning stays outside the compiled region
        with holder.ctx.bind(holder.ctx.context_for(real)):  # what the op reads the batch from
            got = compiled(q, k, v).float()
        reference.init_forward_metadata(real)
        want = reference.forward(q, k, v, layer, real).float()
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=lambda m, real=real: (
            f"compiled decode through torch.ops.backplane.attention at batch {real.batch_size}: {m}"))
        worst = max(worst, float((got - want).abs().max()))
    del holder
    return worst
