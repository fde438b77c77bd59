"""The torch_native MoE backend (moe_reference) against a dense float64 reference written here:
every expert on every token, then each token's k outputs picked and weighted. Odd sizes, no tokens,
one token, every token on one expert, experts nobody chose, all experts chosen, reduced precision,
tensor-parallel halves of the intermediate dimension, and one-line errors for bad input."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from backplane.contracts.moe import MoeBackendContext, MoeLayerInfo
from backplane.moe import TorchNativeMoeBackend, moe_reference, route

HIDDEN, INTER = 40, 22


def dense_reference(x, w13, w2, weights, ids):
    """float64: all experts on all tokens [E, T, H], then out[t] = sum_j weights[t, j] * y[ids[t, j], t]."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    inter = w2.shape[-1]
    gate_up = torch.einsum("th,eih->eti", x, w13)
    y = torch.einsum("eti,ehi->eth", F.silu(gate_up[..., :inter]) * gate_up[..., inter:], w2)
    tokens = torch.arange(x.shape[0])[:, None]
    return (y[ids.long(), tokens] * weights.double()[..., None]).sum(1)


def problem(num_tokens, num_experts, top_k, seed=0, dtype=torch.float32, only=None):
    """Random x and weights; routing from random logits, restricted to the experts `only` if given."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=gen)
    w13 = torch.randn(num_experts, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(num_experts, HIDDEN, INTER, generator=gen) / INTER**0.5
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    if only is not None:
        mask = torch.full((num_experts,), float("-inf"))
        mask[list(only)] = 0.0
        logits = logits + mask
    weights, ids = route(logits, top_k, renormalize=bool(seed % 2))
    return x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids


@pytest.mark.parametrize("num_tokens, num_experts, top_k, only", [
    (1, 4, 1, None),
    (17, 8, 2, None),
    (17, 8, 8, None),  # every expert on every token
    (33, 8, 2, (5, 2)),  # every token on the same two experts, six experts empty
    (5, 64, 8, None),  # most experts empty
    (9, 6, 1, (5,)),  # every token on the last expert
])
def test_moe_reference_equals_the_dense_reference(num_tokens, num_experts, top_k, only):
    x, w13, w2, weights, ids = problem(num_tokens, num_experts, top_k, seed=num_tokens, only=only)
    got = moe_reference(x, w13, w2, weights, ids)
    assert got.dtype == torch.float32 and got.shape == (num_tokens, HIDDEN)
    torch.testing.assert_close(got.double(), dense_reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_no_tokens():
    x, w13, w2, weights, ids = problem(0, 8, 2)
    got = moe_reference(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids)
    assert got.shape == (0, HIDDEN) and got.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
def test_reduced_precision_within_its_rounding(dtype, tol):
    x, w13, w2, weights, ids = problem(23, 8, 2, seed=3, dtype=dtype)
    got = moe_reference(x, w13, w2, weights, ids)
    want = dense_reference(x, w13, w2, weights, ids)
    assert got.dtype == dtype
    assert float((got.double() - want).abs().max()) <= tol * float(want.abs().max())


def test_float64_in_float64_out():
    x, w13, w2, weights, ids = problem(7, 4, 2, seed=1, dtype=torch.float64)
    got = moe_reference(x, w13, w2, weights, ids)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, dense_reference(x, w13, w2, weights, ids), rtol=1e-12, atol=1e-12)


def test_tensor_parallel_halves_add_up_to_the_full_output():
    x, w13, w2, weights, ids = problem(13, 8, 2, seed=5)
    half = INTER // 2
    partial = []
    for rank in range(2):
        cols = slice(rank * half, (rank + 1) * half)
        w13_rank = torch.cat([w13[:, :INTER][:, cols], w13[:, INTER:][:, cols]], dim=1)
        partial.append(moe_reference(x, w13_rank, w2[:, :, cols], weights, ids))
    torch.testing.assert_close(partial[0] + partial[1], moe_reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def _layer(num_experts=8, top_k=2, activation="silu"):
    x, w13, w2, weights, ids = problem(11, num_experts, top_k, seed=2)
    info = MoeLayerInfo(layer_id=3, num_experts=num_experts, top_k=top_k, hidden_size=HIDDEN,
                        intermediate_size=INTER, intermediate_size_per_partition=INTER, renormalize=True,
                        params_dtype=torch.float32, device=torch.device("cpu"), activation=activation)
    return SimpleNamespace(w13_weight=w13, w2_weight=w2, moe_info=info), x, weights, ids


def test_the_backend_applies_the_reference_to_the_layer_weights():
    layer, x, weights, ids = _layer()
    backend = TorchNativeMoeBackend(MoeBackendContext(torch.float32, torch.device("cpu"), max_num_tokens=16))
    backend.register_layer(layer, layer.moe_info)
    backend.process_weights_after_loading(layer)
    got = backend.apply(layer, x, weights, ids)
    torch.testing.assert_close(got.double(), dense_reference(x, layer.w13_weight, layer.w2_weight, weights, ids),
                               rtol=1e-5, atol=1e-5)
    assert TorchNativeMoeBackend().ctx is None  # the lazily built default takes no context


def test_the_backend_refuses_an_activation_it_does_not_have():
    layer, *_ = _layer(activation="gelu")
    with pytest.raises(ValueError, match=r"^torch_native MoE backend: layer 3 activation 'gelu' is not supported; "
                                         r"expected one of silu$"):
        TorchNativeMoeBackend().register_layer(layer, layer.moe_info)


def _bad(name):
    x, w13, w2, weights, ids = problem(4, 8, 2)
    return {
        "x-1d": ((x[0], w13, w2, weights, ids), r"^MoE: x must be \[num_tokens, hidden_size\], got shape \(40,\)$"),
        "w13-hidden": ((x, w13[..., :-1], w2, weights, ids), r"^MoE: expected w13_weight \[E, 2 \* I, H=40\] and "
                                                             r"w2_weight \[E, H, I\], got \(8, 44, 39\) and \(8, 40, 22\)$"),
        "w2-inter": ((x, w13, w2[..., :-2], weights, ids), r"^MoE: expected w13_weight"),
        "ids-tokens": ((x, w13, w2, weights[:3], ids[:3]), r"^MoE: expected topk_weights and topk_ids "
                                                           r"\[num_tokens=4, top_k\], got \(3, 2\) and \(3, 2\)$"),
        "ids-int64": ((x, w13, w2, weights, ids.long()), r"^MoE: expected topk_weights float32 and topk_ids int32 "
                                                         r"\(as backplane.moe.route returns\), got torch.float32 and "
                                                         r"torch.int64$"),
        "ids-range": ((x, w13, w2, weights, ids + 7), r"^MoE: topk_ids out of range; expected expert ids in \[0, 8\), got 7\.\.14$"),
        "ids-negative": ((x, w13, w2, weights, ids - 9), r"^MoE: topk_ids out of range"),
    }[name]


@pytest.mark.parametrize("name", ["x-1d", "w13-hidden", "w2-inter", "ids-tokens", "ids-int64", "ids-range",
                                  "ids-negative"])
def test_bad_input_is_one_line(name):
    args, match = _bad(name)
    with pytest.raises(ValueError, match=match):
        moe_reference(*args)
