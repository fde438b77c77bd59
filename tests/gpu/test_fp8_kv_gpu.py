"""The FP8 KV cache on the GPU: the triton and flashinfer backends over a float8_e4m3fn pool with
per-layer scales against torch_native over the same pool (the FP8 reference: it attends to the
dequantized values), in bf16, eagerly (extend with and without a cached prefix, decode, verify,
draft extend) and replayed from real CUDA graphs (decode, verify, a token-bucket extend) for
lengths other than the captured ones. Run with `pytest -m gpu tests/gpu/test_fp8_kv_gpu.py`.

Tolerance: atol = rtol = 2e-2, bf16 arithmetic (the backends) against fp32 (the reference) on the
same stored values; flashinfer's ragged prefill also rounds the new tokens' dequantized values to bf16.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from backplane.attention.torch_native import TorchNativeAttnBackend
from backplane.contracts.attention import AttentionBackendContext, AttentionLayerInfo
from backplane.contracts.batch import ForwardBatch, ForwardMode
from backplane.contracts.graph import GraphKey
from backplane.contracts.memory import FP8_E4M3, ReqToTokenPool, TokenToKVPool

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BF16 = torch.bfloat16
HEADS, KV_HEADS, HEAD_DIM, MAX_CTX = 32, 8, 128, 1024
LAYER = AttentionLayerInfo(1, HEADS, KV_HEADS, HEAD_DIM, scaling=HEAD_DIM**-0.5)  # layer 1: its own scales
K_SCALE, V_SCALE = 0.03, 0.02  # values ~ N(0, 1) stay below 448 * scale
TOL = dict(atol=2e-2, rtol=2e-2)
E, D, V, DE = ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND


def make_backend(name: str, ctx: AttentionBackendContext):
    """The plugin's backend over ctx, or a skip naming why it cannot run here."""
    if name == "triton":
        pytest.importorskip("triton")
        from backplane.plugins import attention_triton as plugin
        from backplane.plugins.attention_triton import decode_kernels
        from helpers_gpu import interpreted

        if interpreted(decode_kernels._decode_split_kernel):
            pytest.skip("triton kernels defined under TRITON_INTERPRET=1; run `pytest -m gpu tests/gpu`")
    else:
        if importlib.util.find_spec("flashinfer") is None:
            pytest.skip("flashinfer is not installed")
        from backplane.plugins import attention_flashinfer as plugin
    specs = []
    plugin.backplane_register_attention_backends(register=specs.append)
    (spec,) = specs
    assert "fp8_e4m3" in spec.kv_cache_dtypes and spec.available() is None, spec.available()
    return spec.factory(ctx)


def tree_mask(prefix: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """[n, prefix + n]: every node sees the prefix, itself and a random chain of earlier nodes."""
    mask = torch.zeros(n, prefix + n, dtype=torch.bool)
    mask[:, :prefix] = True
    for i in range(n):
        mask[i, prefix + i] = True
        if i:
            mask[i] |= mask[int(torch.randint(0, i, (), generator=gen))]
    return mask


class World:
    """An FP8 pool (scales set on two layers) and requests whose prefixes sit at shuffled slots."""

    def __init__(self, seed: int, num_rows: int = 8):
        self.gen = torch.Generator().manual_seed(seed)
        self.req_pool = ReqToTokenPool(num_rows, MAX_CTX, "cuda")
        self.kv_pool = TokenToKVPool(num_rows * MAX_CTX, 2, KV_HEADS, HEAD_DIM, FP8_E4M3, "cuda")
        self.kv_pool.set_kv_scales(0, 0.5, 0.25)
        self.kv_pool.set_kv_scales(1, K_SCALE, V_SCALE)
        self.rows = [self.req_pool.alloc() for _ in range(num_rows)]
        slots = self.kv_pool.alloc(num_rows * MAX_CTX)[torch.randperm(num_rows * MAX_CTX, generator=self.gen)]
        self.req_pool.req_to_token[self.rows] = slots.view(num_rows, MAX_CTX).int().cuda()
        for layer in range(2):  # random everywhere: a wrong slot or layer shows up as a wrong result
            n = slots.numel()
            self.kv_pool.set_kv_buffer(layer, slots.cuda(), self.randn(n, KV_HEADS), self.randn(n, KV_HEADS))

    def randn(self, n: int, heads: int) -> torch.Tensor:
        return torch.randn(n, heads, HEAD_DIM, generator=self.gen).to(BF16).cuda()

    def batch(self, mode: ForwardMode, seq_lens: list[int], new_lens: list[int], masked: bool = False) -> ForwardBatch:
        """Requests 0..bs-1 whose last new_lens[i] of seq_lens[i] tokens are new (their rows' slots)."""
        bs = len(seq_lens)
        r2t = self.req_pool.req_to_token
        loc = torch.cat([r2t[row, s - n:s].long() for row, s, n in zip(self.rows, seq_lens, new_lens)])
        seq = torch.tensor(seq_lens, dtype=torch.int32)
        prefix = [s - n for s, n in zip(seq_lens, new_lens)]
        extra = {}
        if masked:
            masks = [tree_mask(p, n, self.gen).flatten() for p, n in zip(prefix, new_lens)]
            extra["custom_mask"] = torch.cat(masks).cuda()
            sizes = torch.tensor([0] + [m.numel() for m in masks])
            extra["mask_indptr"] = sizes.cumsum(0).cuda()
        batch = ForwardBatch(
            forward_mode=mode, batch_size=bs, input_ids=torch.zeros(len(loc), dtype=torch.int64, device="cuda"),
            positions=torch.cat([torch.arange(p, s) for p, s in zip(prefix, seq_lens)]).cuda(),
            req_pool_indices=torch.tensor(self.rows[:bs], device="cuda"), seq_lens=seq.cuda(),
            seq_lens_cpu=seq, out_cache_loc=loc, req_to_token_pool=self.req_pool, token_to_kv_pool=self.kv_pool,
            **extra)
        if mode is not D:
            batch.set_extend_lens(prefix, new_lens)
        return batch

    def qkv(self, n: int) -> list[torch.Tensor]:
        return [self.randn(n, h) for h in (HEADS, KV_HEADS, KV_HEADS)]

    def context(self) -> AttentionBackendContext:
        return AttentionBackendContext(HEADS, KV_HEADS, HEAD_DIM, 2, BF16, torch.device("cuda"), self.req_pool,
                                       self.kv_pool, MAX_CTX)


def reference(batch: ForwardBatch, q, k, v) -> torch.Tensor:
    backend = TorchNativeAttnBackend(None)
    backend.init_forward_metadata(batch)
    return backend.forward(q, k, v, LAYER, batch)


def run(backend, batch: ForwardBatch, q, k, v) -> torch.Tensor:
    backend.init_forward_metadata(batch)
    return backend.forward(q, k, v, LAYER, batch)


EAGER = [  # (mode, seq_lens, new_lens, masked)
    (E, [37, 1, 300], [37, 1, 300], False),  # prefill: no cached prefix
    (E, [50, 9, 700], [13, 1, 200], False),  # extend over a cached prefix
    (D, [1, 77, 999, 300], [1, 1, 1, 1], False),
    (V, [6, 400, 65], [4, 4, 4], True),
    (DE, [30, 8, 500], [2, 5, 1], True),
]


@pytest.mark.parametrize("name", ["triton", "flashinfer"])
@pytest.mark.parametrize("mode,seq_lens,new_lens,masked", EAGER, ids=[f"{c[0].value}-{i}" for i, c in enumerate(EAGER)])
def test_eager_matches_torch_native_over_fp8(name, mode, seq_lens, new_lens, masked):
    world = World(seed=len(seq_lens) + sum(new_lens))
    backend = make_backend(name, world.context())
    batch = world.batch(mode, seq_lens, new_lens, masked)
    q, k, v = world.qkv(sum(new_lens))
    got = run(backend, batch, q, k, v)
    stored = world.kv_pool.get_kv_buffer(LAYER.layer_id)[0][batch.out_cache_loc]
    assert torch.equal(stored.view(torch.uint8), world.kv_pool.quantize_kv(LAYER.layer_id, k, v)[0].view(torch.uint8))
    torch.testing.assert_close(got.float(), reference(batch, q, k, v).float(), **TOL)
    assert not backend.fuses_rotary_kv_write(batch)


GRAPHS = [  # (mode, tokens per request, captured seq_lens, replayed seq_lens, masked)
    (D, 1, [5, 1, 300, 77], [9, 1000, 2, 1], False),
    (V, 4, [6, 40, 300], [900, 5, 64], True),
    (E, 0, [40, 16, 300], [9, 100, 10], False),  # a token bucket of 32 new tokens
]


def _replay_batch(static: ForwardBatch, fresh: ForwardBatch) -> ForwardBatch:
    """Copy fresh's device tensors into the captured batch's; the host views and masks come from fresh."""
    for name in ("input_ids", "positions", "req_pool_indices", "seq_lens", "out_cache_loc", "extend_prefix_lens",
                 "extend_seq_lens"):
        if getattr(static, name) is not None:
            getattr(static, name).copy_(getattr(fresh, name))
    return dataclasses.replace(static, seq_lens_cpu=fresh.seq_lens_cpu, custom_mask=fresh.custom_mask,
                               mask_indptr=fresh.mask_indptr, extend_prefix_lens_cpu=fresh.extend_prefix_lens_cpu,
                               extend_seq_lens_cpu=fresh.extend_seq_lens_cpu)


@pytest.mark.parametrize("name", ["triton", "flashinfer"])
@pytest.mark.parametrize("mode,per_request,captured,replayed,masked", GRAPHS, ids=[c[0].value for c in GRAPHS])
def test_graph_replay_matches_torch_native_over_fp8(name, mode, per_request, captured, replayed, masked):
    """One layer captured in a real CUDA graph over the FP8 pool (the scales are launch constants),
    replayed for other lengths: equal to eager torch_native over the same pool."""
    world = World(seed=7)
    backend = make_backend(name, world.context())
    bs = len(captured)
    bucket = 32 if mode is E else 0
    new = ([13, 16, 3], [4, 20, 8]) if mode is E else ([per_request] * bs,) * 2  # (captured, replayed)
    key = GraphKey(mode, bs, per_request, token_bucket=bucket)
    num_tokens = key.num_tokens
    backend.init_graph_state(max_bs=bs, max_num_tokens=num_tokens)
    static = world.batch(mode, captured, new[0], masked)
    q, k, v = world.qkv(num_tokens)
    backend.init_metadata_for_capture(key, static)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: kernels compiled, layer configs learned, outside the capture
        backend.forward(q, k, v, LAYER, static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, LAYER, static)
    for seq_lens, new_lens in ((replayed, new[1]), (captured, new[0])):
        fresh = world.batch(mode, seq_lens, new_lens, masked)
        for t, fresh_t in zip((q, k, v), world.qkv(num_tokens)):
            t.copy_(fresh_t)
        backend.init_metadata_for_replay(key, _replay_batch(static, fresh))
        graph.replay()
        torch.testing.assert_close(out.float(), reference(fresh, q, k, v).float(), **TOL,
                                   msg=f"{name} {mode.value} replayed for {seq_lens}")
