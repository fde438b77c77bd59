"""The Triton custom ops under TRITON_INTERPRET=1 against backplane's native ops (fp32, fp16)."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere: run kernels on CPU

import pytest  # noqa: E402
import torch  # noqa: E402

from backplane.ops import native  # noqa: E402
from backplane.ops.rope import build_cos_sin_cache  # noqa: E402
from backplane.plugins.ops_triton import kernels, ops  # noqa: E402

# fp16: one rounding of the same fp32 value, up to an ulp apart (reduction order)
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}
DTYPES = [torch.float32, torch.float16]
HIDDEN = [64, 100, 1000, 4096]  # powers of two and not
BATCH = [1, 17, 33]


def randn(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(*shape, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("batch", BATCH)
def test_rms_norm(batch, hidden, dtype):
    x, w = randn(batch, hidden, dtype=dtype), randn(hidden, dtype=dtype, seed=1)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), native.rms_norm(x, w, 1e-6), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("batch", BATCH)
def test_fused_add_rms_norm(batch, hidden, dtype):
    x, residual = randn(batch, hidden, dtype=dtype), randn(batch, hidden, dtype=dtype, seed=2)
    w = randn(hidden, dtype=dtype, seed=1)
    x_before, residual_before = x.clone(), residual.clone()
    y, residual_out = ops.fused_add_rms_norm(x, residual, w, 1e-5)
    want_y, want_residual = native.fused_add_rms_norm(x, residual, w, 1e-5)
    # the new residual is the sum rounded to the dtype, bit for bit as native's; the inputs are
    # left as native leaves them (unchanged), so callers may keep using either
    assert torch.equal(residual_out, want_residual)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)
    torch.testing.assert_close(y, want_y, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 100, 1000, 4096])
@pytest.mark.parametrize("batch", BATCH)
def test_silu_and_mul(batch, d, dtype):
    x = randn(batch, 2 * d, dtype=dtype) * 3
    got = ops.silu_and_mul(x)
    assert got.shape == (batch, d) and got.dtype == dtype
    torch.testing.assert_close(got, native.silu_and_mul(x), **TOL[dtype])


def test_strided_and_batched_inputs():
    """Rows of a wider tensor (row stride > hidden), per-head 3-D input (qk-norm), the gate/up halves
    of a [T, 2 * d] view: what the model passes."""
    wide = randn(9, 160)
    x, w = wide[:, 16:80], randn(64, seed=1)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), native.rms_norm(x, w, 1e-6), **TOL[torch.float32])
    heads = randn(5, 3, 16)
    torch.testing.assert_close(ops.rms_norm(heads, w[:16], 1e-6), native.rms_norm(heads, w[:16], 1e-6),
                               **TOL[torch.float32])
    y, r = ops.fused_add_rms_norm(x, x.flip(0), w, 1e-6)
    want = native.fused_add_rms_norm(x, x.flip(0), w, 1e-6)
    assert torch.equal(r, want[1]) and y.is_contiguous()
    torch.testing.assert_close(y, want[0], **TOL[torch.float32])
    torch.testing.assert_close(ops.silu_and_mul(wide[:, :150]), native.silu_and_mul(wide[:, :150]),
                               **TOL[torch.float32])


def test_empty_batch():
    w = randn(64)
    assert ops.rms_norm(torch.empty(0, 64), w, 1e-6).shape == (0, 64)
    y, r = ops.fused_add_rms_norm(torch.empty(0, 64), torch.empty(0, 64), w, 1e-6)
    assert y.shape == r.shape == (0, 64)
    assert ops.silu_and_mul(torch.empty(0, 128)).shape == (0, 64)


def test_fallbacks_to_native():
    """fp64 and rows wider than one block are not the kernels': the native implementation answers."""
    x = randn(3, 64).double()
    assert torch.equal(ops.rms_norm(x, randn(64).double(), 1e-6), native.rms_norm(x, randn(64).double(), 1e-6))
    assert ops.MAX_NORM_HIDDEN == kernels.MAX_NORM_HIDDEN


def _rope_inputs(num_tokens, num_heads, num_kv_heads, head_dim, dtype, pos_dtype=torch.int64):
    q = randn(num_tokens, num_heads, head_dim, dtype=dtype, seed=3)
    k = randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, seed=4)
    v = randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, seed=5)
    positions = torch.randint(0, 300, (num_tokens,), generator=torch.Generator().manual_seed(num_tokens))
    return positions.to(pos_dtype), q, k, v


ROPE_CASES = [  # num_tokens, heads, kv heads, head_dim, rotary_dim
    (1, 4, 2, 64, 64),
    (17, 8, 8, 128, 128),
    (33, 6, 2, 64, 32),  # partial rotary: the last 32 dims pass through
    (5, 3, 1, 80, 80),  # non-power-of-two head dim and head counts
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("case", ROPE_CASES)
def test_rotary_kv_write(case, is_neox, dtype):
    num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim = case
    positions, q, k, v = _rope_inputs(num_tokens, num_heads, num_kv_heads, head_dim, dtype,
                                      torch.int32 if num_tokens % 2 else torch.int64)
    cache = build_cos_sin_cache(rotary_dim, 512, 10000.0)
    num_slots = 2 * num_tokens + 1
    loc = torch.randperm(num_slots - 1, generator=torch.Generator().manual_seed(7))[:num_tokens] + 1
    caches = [randn(num_slots, num_kv_heads, head_dim, dtype=dtype, seed=s) for s in (8, 9)]
    want_caches = [c.clone() for c in caches]
    q_before, k_before, v_before = q.clone(), k.clone(), v.clone()
    q_rot, k_rot = ops.rotary_kv_write(positions, q, k, v, cache, is_neox, *caches, loc)
    want_q, want_k = native.rotary_kv_write(positions, q, k, v, cache, is_neox, *want_caches, loc)
    torch.testing.assert_close(q_rot, want_q, **TOL[dtype])
    torch.testing.assert_close(k_rot, want_k, **TOL[dtype])
    torch.testing.assert_close(caches[0], want_caches[0], **TOL[dtype])
    assert torch.equal(caches[1], want_caches[1])  # v copied as is; untouched slots kept
    assert torch.equal(q, q_before) and torch.equal(k, k_before) and torch.equal(v, v_before)
    got_q, got_k = ops.rotary_embedding(positions, q, k, cache, is_neox)
    torch.testing.assert_close(got_q, want_q, **TOL[dtype])
    torch.testing.assert_close(got_k, want_k, **TOL[dtype])


def test_rotary_kv_write_casts_to_the_cache_dtype():
    """fp16 activations into an fp32 cache (and strided q/k/v, as sliced from a fused qkv)."""
    positions, q, k, v = _rope_inputs(7, 4, 2, 64, torch.float16)
    qkv = torch.cat([q, k, v], dim=1)  # [T, 8, 64]: q, k, v are strided views of it
    q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
    cache = build_cos_sin_cache(64, 512, 10000.0)
    loc = torch.arange(1, 8)
    caches = [torch.zeros(9, 2, 64) for _ in range(2)]
    want_caches = [c.clone() for c in caches]
    got = ops.rotary_kv_write(positions, q, k, v, cache, True, *caches, loc)
    want = native.rotary_kv_write(positions, q, k, v, cache, True, *want_caches, loc)
    for g, w in zip((*got, *caches), (*want, *want_caches)):
        torch.testing.assert_close(g, w, **TOL[torch.float16])
    assert caches[0].dtype == torch.float32 and not caches[0][0].any()  # the dump slot untouched


def test_every_op_traced_by_torch_compile_stays_opaque():
    """All seven table functions in one fullgraph compile (dynamic shapes): Dynamo records each as a
    torch.ops.ops_triton.* call (rotary_kv_write mutating the caches), and the results equal native's."""
    from torch._inductor.compile_fx import compile_fx

    seen = set()

    def recording_backend(gm, example_inputs):
        seen.update(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return compile_fx(gm, example_inputs)

    def block(table, x, residual, w, gate_up, positions, q, k, v, cos_sin, k_cache, v_cache, loc, logits, router_logits):
        y = table["rms_norm"](x, w, 1e-6)
        y2, residual_out = table["fused_add_rms_norm"](x, residual, w, 1e-6)
        act = table["silu_and_mul"](gate_up)
        rq, rk = table["rotary_embedding"](positions, q, k, cos_sin, True)
        fq, fk = table["rotary_kv_write"](positions, q, k, v, cos_sin, True, k_cache, v_cache, loc)
        tokens, logprobs = table["greedy_sample"](logits)
        topk_weights, topk_ids = table["moe_route"](router_logits, 4, True)
        return y, y2, residual_out, act, rq, rk, fq, fk, tokens, logprobs, topk_weights, topk_ids

    positions, q, k, v = _rope_inputs(9, 4, 2, 64, torch.float32)
    args = [randn(9, 100), randn(9, 100, seed=1), randn(100, seed=2), randn(9, 2 * 77, seed=3), positions, q, k, v,
            build_cos_sin_cache(64, 512, 10000.0)]
    caches = [randn(20, 2, 64, seed=s) for s in (4, 5)]
    want_caches = [c.clone() for c in caches]
    loc = torch.randperm(19)[:9] + 1
    compiled = torch.compile(block, backend=recording_backend, fullgraph=True, dynamic=True)
    logits, router_logits = randn(9, 300, seed=6), randn(9, 60, seed=7)
    got = compiled(ops.TRITON_OPS, *args, *caches, loc, logits, router_logits)
    want = block(native.NATIVE_OPS, *args, *want_caches, loc, logits, router_logits)
    ops_seen = {op.split(".")[1] for op in seen if op.startswith("ops_triton.")}
    assert ops_seen == set(ops.TRITON_OPS), sorted(seen)
    for g, w in zip((*got, *caches), (*want, *want_caches)):
        torch.testing.assert_close(g, w, **TOL[torch.float32])
