"""Native custom ops against plain formulas, the rope cache against transformers, and op dispatch."""

from __future__ import annotations

import math

import pytest
import torch

from backplane.ops import builtin as ops_builtin
from backplane.ops.dispatch import OP_NAMES, CustomOps, resolve_custom_ops
from backplane.ops.native import (
    NATIVE_OPS,
    fused_add_rms_norm,
    gelu,
    gelu_and_mul,
    quick_gelu,
    rms_norm,
    rotary_embedding,
    rotary_kv_write,
    silu_and_mul,
)
from backplane.ops.rope import build_cos_sin_cache
from backplane.plugin.registry import CustomOpImpl, Registry

GEN = torch.Generator().manual_seed(0)


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=GEN).to(dtype)


# -- elementwise ops ------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 17), (17, 33), (3, 5, 64)])
def test_rms_norm(shape):
    x, w, eps = randn(*shape), randn(shape[-1]), 1e-5
    expected = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w
    torch.testing.assert_close(rms_norm(x, w, eps), expected, rtol=1e-5, atol=1e-6)


def test_rms_norm_keeps_half_dtype_and_computes_in_fp32():
    x, w = randn(7, 129, dtype=torch.bfloat16), randn(129, dtype=torch.bfloat16)
    y = rms_norm(x, w, 1e-6)
    assert y.dtype == torch.bfloat16
    expected = rms_norm(x.float(), w.float(), 1e-6)
    torch.testing.assert_close(y.float(), expected, rtol=1e-2, atol=1e-2)


def test_fused_add_rms_norm():
    x, res, w = randn(17, 33), randn(17, 33), randn(33)
    y, res_out = fused_add_rms_norm(x, res, w, 1e-6)
    s = x + res
    torch.testing.assert_close(res_out, s)
    torch.testing.assert_close(y, s / torch.sqrt((s * s).mean(-1, keepdim=True) + 1e-6) * w, rtol=1e-5, atol=1e-6)


def erf_gelu(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def tanh_gelu(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def test_silu_and_mul():
    x = randn(17, 2 * 19)
    gate, up = x[:, :19], x[:, 19:]
    torch.testing.assert_close(silu_and_mul(x), gate / (1 + torch.exp(-gate)) * up)


@pytest.mark.parametrize("approximate, formula", [("none", erf_gelu), ("tanh", tanh_gelu)])
def test_gelu_and_mul_and_gelu(approximate, formula):
    x = randn(5, 3, 2 * 11)
    torch.testing.assert_close(gelu_and_mul(x, approximate), formula(x[..., :11]) * x[..., 11:], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gelu(x, approximate), formula(x), rtol=1e-5, atol=1e-6)


def test_quick_gelu():
    x = randn(17, 9)
    torch.testing.assert_close(quick_gelu(x), x / (1 + torch.exp(-1.702 * x)))


# -- rotary ---------------------------------------------------------------------------------------


def reference_rotary(x, positions, inv_freq, is_neox):
    """x: [T, H, D]; rotates pairs by angle pos * inv_freq[i], one pair at a time."""
    out = x.clone()
    half = inv_freq.numel()
    for t, pos in enumerate(positions.tolist()):
        for i in range(half):
            a, b = (i, i + half) if is_neox else (2 * i, 2 * i + 1)
            angle = pos * float(inv_freq[i])
            c, s = math.cos(angle), math.sin(angle)
            out[t, :, a] = x[t, :, a] * c - x[t, :, b] * s
            out[t, :, b] = x[t, :, b] * c + x[t, :, a] * s
    return out


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_dim, rotary_dim", [(16, 16), (24, 8)])
def test_rotary_embedding(is_neox, head_dim, rotary_dim):
    base, positions = 1000.0, torch.tensor([0, 3, 17, 100, 5], dtype=torch.int64)
    q, k = randn(5, 3, head_dim), randn(5, 1, head_dim)
    cache = build_cos_sin_cache(rotary_dim, 128, base)
    assert cache.shape == (128, rotary_dim) and cache.dtype == torch.float32
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    q_out, k_out = rotary_embedding(positions, q, k, cache, is_neox)
    torch.testing.assert_close(q_out, reference_rotary(q, positions, inv_freq, is_neox), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(k_out, reference_rotary(k, positions, inv_freq, is_neox), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(q_out[..., rotary_dim:], q[..., rotary_dim:])  # partial rotary leaves the rest


def test_neox_and_gptj_differ():
    positions, q, k = torch.tensor([1, 2]), randn(2, 2, 8), randn(2, 2, 8)
    cache = build_cos_sin_cache(8, 4, 10000.0)
    assert not torch.allclose(rotary_embedding(positions, q, k, cache, True)[0],
                              rotary_embedding(positions, q, k, cache, False)[0])


@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_kv_write_rotates_and_writes_the_cache(is_neox):
    """rotary_kv_write = the plain rotary formula on q and k, plus k_rot and v written at loc in the
    cache's dtype; every other slot and the inputs are left as they were."""
    base, positions = 1000.0, torch.tensor([0, 3, 17, 100, 5], dtype=torch.int64)
    q, k, v = randn(5, 3, 16), randn(5, 1, 16), randn(5, 1, 16)
    inputs = [t.clone() for t in (q, k, v)]
    cache = build_cos_sin_cache(16, 128, base)
    inv_freq = 1.0 / base ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    k_cache, v_cache = randn(9, 1, 16, dtype=torch.bfloat16), randn(9, 1, 16, dtype=torch.bfloat16)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    loc = torch.tensor([8, 1, 4, 2, 6])
    q_rot, k_rot = rotary_kv_write(positions, q, k, v, cache, is_neox, k_cache, v_cache, loc)
    torch.testing.assert_close(q_rot, reference_rotary(q, positions, inv_freq, is_neox), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(k_rot, reference_rotary(k, positions, inv_freq, is_neox), rtol=1e-4, atol=1e-5)
    assert torch.equal(k_cache[loc], k_rot.to(torch.bfloat16)) and torch.equal(v_cache[loc], v.to(torch.bfloat16))
    untouched = torch.tensor([0, 3, 5, 7])
    assert torch.equal(k_cache[untouched], k_before[untouched]) and torch.equal(v_cache[untouched], v_before[untouched])
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), inputs))


def test_rotary_bf16_keeps_dtype():
    positions, q, k = torch.tensor([4, 9, 2]), randn(3, 4, 32, dtype=torch.bfloat16), randn(3, 2, 32, dtype=torch.bfloat16)
    cache = build_cos_sin_cache(32, 16, 10000.0)
    q_out, k_out = rotary_embedding(positions, q, k, cache, True)
    assert q_out.dtype == k_out.dtype == torch.bfloat16
    torch.testing.assert_close(q_out.float(), rotary_embedding(positions, q.float(), k.float(), cache, True)[0],
                               rtol=1e-2, atol=1e-2)


ROPE_SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
}


@pytest.mark.parametrize("name", list(ROPE_SCALINGS))
def test_cos_sin_cache_matches_transformers(name):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    scaling, head_dim, max_pos = ROPE_SCALINGS[name], 64, 1024
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=head_dim, rope_theta=500000.0,
                         max_position_embeddings=max_pos, rope_scaling=scaling)
    positions = torch.tensor([[0, 1, 7, 100, 255, 256, 1000]])
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions)
    cache = build_cos_sin_cache(head_dim, max_pos, 500000.0, scaling)[positions[0]]
    torch.testing.assert_close(cache[:, : head_dim // 2], cos[0, :, : head_dim // 2], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cache[:, head_dim // 2 :], sin[0, :, : head_dim // 2], rtol=1e-6, atol=1e-6)
    if scaling is not None:  # the scaling really changes the cache
        assert not torch.allclose(cache, build_cos_sin_cache(head_dim, max_pos, 500000.0)[positions[0]])


def test_unsupported_rope_type_is_named():
    with pytest.raises(ValueError, match="unsupported rope type 'warp'; expected one of: default, linear, llama3, "
                                         "longrope, yarn, dynamic"):
        build_cos_sin_cache(8, 4, 10000.0, {"rope_type": "warp", "factor": 2.0})


# -- dispatch -------------------------------------------------------------------------------------


def fake(tag):
    def fn(*args, **kwargs):
        return tag

    return fn


def native_impls():
    impls = []
    ops_builtin.backplane_register_custom_ops(register=impls.append)
    return impls


def test_builtin_plugin_registers_every_native_op_on_both_platforms():
    registry = Registry()
    ops_builtin.backplane_register_custom_ops(register=registry.callback("custom_op", "builtin", None))
    keys = set(registry.specs("custom_op"))
    assert keys == {f"{op}/{p}/native" for op in OP_NAMES for p in ("cpu", "cuda")}


def test_highest_priority_usable_impl_wins_per_platform():
    impls = native_impls() + [
        CustomOpImpl("rms_norm", "cuda", fake("fast"), "flashinfer", priority=10),
        CustomOpImpl("rms_norm", "cuda", fake("faster"), "broken", priority=20, available=lambda: "no lib"),
        CustomOpImpl("silu_and_mul", "cpu", fake("cpu-fast"), "mine", priority=5),
    ]
    cuda = resolve_custom_ops(impls, "cuda", {})
    assert cuda.rms_norm() == "fast" and cuda.chosen["rms_norm"] == "flashinfer"
    assert cuda.silu_and_mul is NATIVE_OPS["silu_and_mul"] and cuda.chosen["silu_and_mul"] == "native"
    cpu = resolve_custom_ops(impls, "cpu", {})
    assert cpu.rms_norm is rms_norm and cpu.silu_and_mul() == "cpu-fast"


def test_fallback_past_an_unusable_impl_is_logged(caplog):
    impls = native_impls() + [
        CustomOpImpl("rms_norm", "cuda", fake("faster"), "broken", priority=20, available=lambda: "no lib"),
        CustomOpImpl("gelu", "cuda", fake("slow"), "slowpoke", priority=-1, available=lambda: "never"),
    ]
    with caplog.at_level("WARNING", logger="backplane.ops.dispatch"):
        ops = resolve_custom_ops(impls, "cuda", {})
    assert ops.chosen["rms_norm"] == "native"
    assert caplog.messages == ["custom op rms_norm on cuda: using native because broken (priority 20) cannot run: no lib"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="backplane.ops.dispatch"):
        resolve_custom_ops(native_impls(), "cuda", {})
    assert caplog.messages == []


def test_override_picks_named_impl():
    impls = native_impls() + [CustomOpImpl("rms_norm", "cuda", fake("fast"), "flashinfer", priority=10)]
    ops = resolve_custom_ops(impls, "cuda", {"rms_norm": "native"})
    assert ops.rms_norm is rms_norm and ops.chosen["rms_norm"] == "native"
    low = [CustomOpImpl("gelu", "cuda", fake("low"), "slowpoke", priority=-1)]
    assert resolve_custom_ops(native_impls() + low, "cuda", {"gelu": "slowpoke"}).gelu() == "low"


def test_override_unknown_op():
    with pytest.raises(ValueError, match=r"custom op override 'rmsnorm=native': unknown op 'rmsnorm'; "
                                         r"expected one of: rms_norm, fused_add_rms_norm"):
        resolve_custom_ops(native_impls(), "cpu", {"rmsnorm": "native"})


def test_override_unknown_impl_lists_registered():
    impls = native_impls() + [CustomOpImpl("rms_norm", "cuda", fake("fast"), "flashinfer", priority=10)]
    with pytest.raises(ValueError, match=r"custom op override 'rms_norm=triton': unknown implementation "
                                         r"'triton' for op 'rms_norm' on cuda; registered: flashinfer, native"):
        resolve_custom_ops(impls, "cuda", {"rms_norm": "triton"})


def test_override_unavailable_impl_gives_reason():
    impls = native_impls() + [CustomOpImpl("rms_norm", "cuda", fake("x"), "flashinfer", 10,
                                           available=lambda: "flashinfer is not installed")]
    with pytest.raises(ValueError, match="'rms_norm=flashinfer'.*cannot run here: flashinfer is not installed"):
        resolve_custom_ops(impls, "cuda", {"rms_norm": "flashinfer"})


def test_native_table():
    ops = CustomOps.native()
    assert all(getattr(ops, op) is NATIVE_OPS[op] for op in OP_NAMES)
    assert ops.chosen == {op: "native" for op in OP_NAMES}
    assert resolve_custom_ops([], "cpu", {}) == ops  # nothing registered: native


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_native_ops_on_cuda_match_cpu(dtype, tol):
    x, res, w = randn(17, 96, dtype=dtype), randn(17, 96, dtype=dtype), randn(96, dtype=dtype)
    positions, q, k = torch.tensor([0, 5, 300]), randn(3, 4, 64, dtype=dtype), randn(3, 2, 64, dtype=dtype)
    cache = build_cos_sin_cache(64, 512, 10000.0)
    cases = {
        "rms_norm": (rms_norm, (x, w, 1e-6)),
        "fused_add_rms_norm": (fused_add_rms_norm, (x, res, w, 1e-6)),
        "silu_and_mul": (silu_and_mul, (x,)),
        "gelu_and_mul": (gelu_and_mul, (x, "tanh")),
        "rotary_embedding": (rotary_embedding, (positions, q, k, cache, True)),
    }
    for name, (fn, args) in cases.items():
        on_cpu = fn(*args)
        on_gpu = fn(*[a.cuda() if isinstance(a, torch.Tensor) else a for a in args])
        for c, g in zip(on_cpu if isinstance(on_cpu, tuple) else (on_cpu,), on_gpu if isinstance(on_gpu, tuple) else (on_gpu,)):
            assert g.device.type == "cuda" and g.dtype == dtype, name
            torch.testing.assert_close(g.cpu().float(), c.float(), rtol=tol, atol=tol, msg=name)
