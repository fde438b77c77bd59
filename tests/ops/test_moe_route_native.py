"""The native `moe_route` op: bit for bit the router `backplane.moe.route` ran before it became an op
(weights and ids, ties included), `route` still checking its arguments in one line before any
arithmetic, and FusedMoE routing through the op of its context's table."""

from __future__ import annotations

import pytest
import torch

from backplane.layers import FusedMoE
from backplane.models import ModelContext
from backplane.moe import route
from backplane.ops import native
from backplane.ops.dispatch import CustomOps
from backplane.ops.names import OP_NAMES


def old_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`backplane.moe.route`'s arithmetic before the op existed, written out again."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids.to(torch.int32)


def logits(num_tokens: int, num_experts: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random router logits on a grid of 1/8 (many exact ties), plus a planted tie in every row."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(num_tokens, num_experts, generator=gen) * 8).round() / 8
    if num_tokens and num_experts > 3:
        x[:, 3] = x[:, 1] = x.max(dim=-1).values + 1  # the two largest are equal
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_experts", [8, 60, 128])
@pytest.mark.parametrize("num_tokens", [0, 1, 7, 64])
def test_native_equals_the_old_route(num_tokens, num_experts, dtype):
    x = logits(num_tokens, num_experts, dtype, seed=num_tokens + num_experts)
    for top_k in range(1, 9):
        for renormalize in (True, False):
            weights, ids = native.moe_route(x, top_k, renormalize)
            want_weights, want_ids = old_route(x, top_k, renormalize)
            assert weights.dtype == torch.float32 and ids.dtype == torch.int32
            assert weights.shape == ids.shape == (num_tokens, top_k)
            assert torch.equal(weights, want_weights) and torch.equal(ids, want_ids)
            public = route(x, top_k, renormalize)
            assert torch.equal(public[0], want_weights) and torch.equal(public[1], want_ids)


def test_the_op_is_in_every_table():
    assert "moe_route" in OP_NAMES
    assert native.NATIVE_OPS["moe_route"] is native.moe_route
    assert CustomOps.native().moe_route is native.moe_route


@pytest.mark.parametrize("args, message", [
    ((torch.zeros(2, 4), 2, True, "sigmoid"), "route: scoring 'sigmoid' is not supported; expected one of softmax"),
    ((torch.zeros(2, 3, 4), 2, True), r"route: router_logits must be \[num_tokens, num_experts\], got shape \(2, 3, 4\)"),
    ((torch.zeros(2, 4), 0, True), r"route: top_k 0 out of range; expected 1 <= top_k <= num_experts \(4\)"),
    ((torch.zeros(2, 4), 5, False), r"route: top_k 5 out of range; expected 1 <= top_k <= num_experts \(4\)"),
])
def test_route_checks_before_any_arithmetic(args, message, monkeypatch):
    calls = []
    monkeypatch.setattr(native, "moe_route", lambda *a: calls.append(a))
    with pytest.raises(ValueError, match=f"^{message}$") as error:
        route(*args)
    assert "\n" not in str(error.value) and not calls


def test_fused_moe_routes_through_its_tables_op():
    seen = []

    def recording(router_logits, top_k, renormalize):
        seen.append((tuple(router_logits.shape), top_k, renormalize))
        return native.moe_route(router_logits, top_k, renormalize)

    ctx = ModelContext()
    ctx.ops = CustomOps(**{**native.NATIVE_OPS, "moe_route": recording})
    layer = FusedMoE(6, 3, 16, 8, ctx, layer_id=0, renormalize=False)
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.1)
    layer(torch.randn(5, 16))
    assert seen == [((5, 6), 3, False)]
