"""The ops_triton custom ops on the GPU: bf16/fp16/fp32 kernels against backplane's native ops,
inside a captured CUDA graph (inputs refreshed in place, no host synchronization), under
torch.compile (kept as opaque torch.ops.ops_triton.* calls), and tiny-llama generation with them."""

from __future__ import annotations

import pytest
import torch

from backplane import Engine, SamplingParams
from backplane.ops import native
from backplane.ops.rope import build_cos_sin_cache
from backplane.plugins.ops_triton import CUDA_PRIORITY, ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# bf16: one rounding of (nearly) the same fp32 value, an ulp (2^-8 relative) apart at most
TOL = {
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.float32: dict(rtol=1e-5, atol=1e-5),
}
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
HIDDEN = [64, 100, 1000, 4096, 5120, 8192]
BATCH = [1, 17, 33, 257]
TRITON_OPS = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding", "rotary_kv_write")


def randn(*shape, dtype=torch.bfloat16, seed=0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed + sum(shape))
    return torch.randn(*shape, generator=gen, device="cuda").to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("batch", BATCH)
def test_norms(batch, hidden, dtype):
    x, residual, w = randn(batch, hidden, dtype=dtype), randn(batch, hidden, dtype=dtype, seed=1), randn(hidden, dtype=dtype, seed=2)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), native.rms_norm(x, w, 1e-6), **TOL[dtype])
    x_before, residual_before = x.clone(), residual.clone()
    y, residual_out = ops.fused_add_rms_norm(x, residual, w, 1e-5)
    want_y, want_residual = native.fused_add_rms_norm(x, residual, w, 1e-5)
    assert torch.equal(residual_out, want_residual)  # the sum rounded to the dtype, as native's
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)  # inputs unchanged, as native
    torch.testing.assert_close(y, want_y, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 100, 1000, 8192, 14336])
@pytest.mark.parametrize("batch", BATCH)
def test_silu_and_mul(batch, d, dtype):
    x = randn(batch, 2 * d, dtype=dtype) * 3
    torch.testing.assert_close(ops.silu_and_mul(x), native.silu_and_mul(x), **TOL[dtype])


ROPE_CASES = [  # num_tokens, heads, kv heads, head_dim, rotary_dim
    (1, 32, 8, 128, 128),
    (33, 32, 8, 128, 128),
    (257, 16, 2, 64, 64),
    (17, 6, 2, 64, 32),  # partial rotary
    (5, 3, 1, 80, 80),  # non-power-of-two head dim and head counts
]


def _rope_case(case, dtype, cache_dtype=None):
    num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim = case
    q = randn(num_tokens, num_heads, head_dim, dtype=dtype, seed=3)
    k = randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, seed=4)
    v = randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, seed=5)
    positions = torch.randint(0, 4000, (num_tokens,), device="cuda")
    cos_sin = build_cos_sin_cache(rotary_dim, 4096, 500000.0).cuda()
    num_slots = 2 * num_tokens + 1
    loc = torch.randperm(num_slots - 1, device="cuda")[:num_tokens] + 1
    caches = [randn(num_slots, num_kv_heads, head_dim, dtype=cache_dtype or dtype, seed=s) for s in (8, 9)]
    return positions, q, k, v, cos_sin, caches, loc


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("case", ROPE_CASES)
def test_rotary_kv_write(case, is_neox, dtype):
    positions, q, k, v, cos_sin, caches, loc = _rope_case(case, dtype)
    want_caches = [c.clone() for c in caches]
    got_q, got_k = ops.rotary_kv_write(positions, q, k, v, cos_sin, is_neox, *caches, loc)
    want_q, want_k = native.rotary_kv_write(positions, q, k, v, cos_sin, is_neox, *want_caches, loc)
    torch.testing.assert_close(got_q, want_q, **TOL[dtype])
    torch.testing.assert_close(got_k, want_k, **TOL[dtype])
    torch.testing.assert_close(caches[0], want_caches[0], **TOL[dtype])
    assert torch.equal(caches[1], want_caches[1])
    rot_q, rot_k = ops.rotary_embedding(positions, q, k, cos_sin, is_neox)
    torch.testing.assert_close(rot_q, want_q, **TOL[dtype])
    torch.testing.assert_close(rot_k, want_k, **TOL[dtype])


class _Inputs:
    """Static inputs of every op, refreshed in place between replays."""

    def __init__(self, num_tokens: int, hidden: int = 4096, d: int = 14336):
        self.x, self.residual = randn(num_tokens, hidden), randn(num_tokens, hidden, seed=1)
        self.w = randn(hidden, seed=2)
        self.gate_up = randn(num_tokens, 2 * d, seed=3)
        self.positions, self.q, self.k, self.v, self.cos_sin, self.caches, self.loc = _rope_case(
            (num_tokens, 32, 8, 128, 128), torch.bfloat16)

    def refresh(self, seed: int) -> None:
        for t in (self.x, self.residual, self.w, self.gate_up, self.q, self.k, self.v, *self.caches):
            t.copy_(randn(*t.shape, dtype=t.dtype, seed=seed))
        self.positions.copy_(torch.randint(0, 4000, self.positions.shape, device="cuda"))
        self.loc.copy_(torch.randperm(self.caches[0].shape[0] - 1, device="cuda")[: self.loc.shape[0]] + 1)


def _run_all(table, s: _Inputs):
    """Every op once, with the table's implementations; returns every output (caches included)."""
    y = table["rms_norm"](s.x, s.w, 1e-6)
    y2, residual_out = table["fused_add_rms_norm"](s.x, s.residual, s.w, 1e-6)
    act = table["silu_and_mul"](s.gate_up)
    rq, rk = table["rotary_embedding"](s.positions, s.q, s.k, s.cos_sin, True)
    fq, fk = table["rotary_kv_write"](s.positions, s.q, s.k, s.v, s.cos_sin, True, *s.caches, s.loc)
    return [y, y2, residual_out, act, rq, rk, fq, fk, *s.caches]


@pytest.mark.parametrize("num_tokens", [1, 33])
def test_inside_a_captured_cuda_graph(num_tokens):
    """Captured once, replayed over fresh inputs written in place: equal to native on those inputs.
    Eager launches under torch's sync debug mode "error": no host synchronization."""
    table = ops.TRITON_OPS
    s = _Inputs(num_tokens)
    torch.cuda.set_sync_debug_mode("error")
    try:
        _run_all(table, s)  # compiles the kernels (no device-to-host copy: never a sync)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _run_all(table, s)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _run_all(table, s)
    for seed in range(3):
        s.refresh(100 + seed)
        caches_before = [c.clone() for c in s.caches]
        graph.replay()
        torch.cuda.synchronize()
        got = [t.clone() for t in outs]
        s.caches = [c.copy_(b) for c, b in zip(s.caches, caches_before)]
        want = _run_all(native.NATIVE_OPS, s)
        for i, (g, w) in enumerate(zip(got, want)):
            if i == 2:  # the residual sum
                assert torch.equal(g, w), "residual_out"
            else:
                torch.testing.assert_close(g, w, **TOL[torch.bfloat16], msg=f"output {i}")


def test_under_torch_compile_kept_opaque():
    """A block of the table's functions compiled with fullgraph=True: the graph Dynamo hands to
    Inductor holds one torch.ops.ops_triton.* call per op, and the result equals native's."""
    from torch._inductor.compile_fx import compile_fx

    seen = set()

    def recording_backend(gm, example_inputs):
        seen.update(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return compile_fx(gm, example_inputs)

    s = _Inputs(17)
    want_caches = [c.clone() for c in s.caches]
    compiled = torch.compile(lambda inputs: _run_all(ops.TRITON_OPS, inputs), backend=recording_backend,
                             fullgraph=True, dynamic=True)
    got = compiled(s)
    got_caches = [c.clone() for c in s.caches]
    s.caches = [c.copy_(b) for c, b in zip(s.caches, want_caches)]
    want = _run_all(native.NATIVE_OPS, s)
    assert {f"ops_triton.{op}.default" for op in TRITON_OPS} <= seen, sorted(seen)
    for i, (g, w) in enumerate(zip(got[:-2] + got_caches, want)):
        torch.testing.assert_close(g, w, **TOL[torch.bfloat16], msg=f"output {i}")


FORCED = [f"{op}=triton" for op in TRITON_OPS]
NATIVE = [f"{op}=native" for op in TRITON_OPS]


def _generate(**kw) -> tuple[Engine, list[list[int]]]:
    engine = Engine("tiny-llama", device="cuda", dtype="float32", attention_backend="triton",
                    max_total_tokens=20000, max_running_requests=16, cuda_graph_max_bs=16, **kw)
    prompts = [[5 + i, 7, 9 + 2 * i] * (i + 1) for i in range(12)]
    params = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    return engine, [out.token_ids for out in engine.generate(input_ids=prompts, sampling_params=params)]


def test_auto_picks_triton_on_cuda():
    engine, _ = _generate(disable_cuda_graph=True)
    chosen = engine.backends["custom_ops"]
    # FlashInfer's ops (priority 100) win where it is installed; else triton (50) over native (0)
    assert CUDA_PRIORITY == 50
    assert all(chosen[op] in ("triton", "flashinfer") for op in ("rms_norm", "fused_add_rms_norm", "silu_and_mul"))
    assert chosen["rotary_kv_write"] == "triton"


@pytest.mark.parametrize("mode", ["graphs", "graphs+compile", "eager+compile"])
def test_generation_with_the_triton_ops_equals_native(mode):
    """Greedy tokens with every triton op forced (and the fused rotary + K/V write in the triton
    attention backend) against the same engine with native ops, in fp32."""
    kw = {"graphs": {}, "graphs+compile": {"enable_torch_compile": True},
          "eager+compile": {"enable_torch_compile": True, "disable_cuda_graph": True}}[mode]
    engine, got = _generate(custom_ops=FORCED, **kw)
    assert {op: engine.backends["custom_ops"][op] for op in TRITON_OPS} == {op: "triton" for op in TRITON_OPS}
    _, want = _generate(custom_ops=NATIVE, **kw)
    same = sum(a == b for a, b in zip(got, want))
    assert same >= len(want) - 1, f"{same}/{len(want)} identical"


# -- moe_route (the default on CUDA since the A/B of 2026-12-07; --custom-ops moe_route=native for the old) --


def route_reference(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of softmax(logits) in fp32, equal probabilities in increasing expert id (stable sort)."""
    weights, ids = torch.sort(torch.softmax(logits.float(), dim=-1), dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def check_route(weights: torch.Tensor, ids: torch.Tensor, logits: torch.Tensor, top_k: int, renormalize: bool) -> None:
    want_weights, want_ids = route_reference(logits, top_k, renormalize)
    native_weights, native_ids = native.moe_route(logits, top_k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (logits.shape[0], top_k)
    assert torch.equal(ids, want_ids)
    tie_free = (native_ids == want_ids).all(dim=-1)
    assert torch.equal(ids[tie_free], native_ids[tie_free])
    torch.testing.assert_close(weights, native_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("num_experts", [8, 60, 128, 1024])
@pytest.mark.parametrize("num_tokens", [1, 17, 257])
def test_moe_route_bf16(num_tokens, num_experts):
    logits = randn(num_tokens, num_experts) * 2
    logits[:, 5] = logits[:, 2] = logits.max(dim=-1).values + 1  # a planted tie on top: 2 first
    for top_k in (1, 2, 8):
        for renormalize in (True, False):
            weights, ids = ops.moe_route(logits, top_k, renormalize)
            check_route(weights, ids, logits, top_k, renormalize)
            assert (ids[:, 0] == 2).all() and (top_k == 1 or (ids[:, 1] == 5).all())


def test_moe_route_inside_a_captured_cuda_graph():
    """Captured once over a static logits buffer, replayed over fresh logits written in place; eager
    launches under torch's sync debug mode "error" (no host synchronization); no tokens, no launch."""
    logits = randn(8, 128)
    assert ops.moe_route(logits[:0], 8, True)[0].shape == (0, 8)
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.moe_route(logits, 8, True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.moe_route(logits, 8, True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = ops.moe_route(logits, 8, True)
    for seed in range(3):
        logits.copy_(randn(8, 128, seed=100 + seed))
        graph.replay()
        torch.cuda.synchronize()
        check_route(weights, ids, logits, 8, True)
