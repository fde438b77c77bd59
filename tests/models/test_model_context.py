"""ModelContext and its ForwardContext: the layers run under the bound context's backend inside the
block only; nothing is bound after it, also after an exception; forwards of one model do not nest.
`use_attention` (0.1) still works, with a DeprecationWarning."""

from __future__ import annotations

import pytest
import torch

from backplane.contracts.forward_context import ForwardContext, NestedForwardError
from backplane.layers.attention import Attention
from backplane.models.base import ModelContext


class Named:
    """A stand-in backend: its forward returns q scaled by its own factor, and records the call."""

    def __init__(self, factor: float):
        self.factor, self.calls = factor, 0

    def forward(self, q, k, v, info, batch):
        self.calls += 1
        return q * self.factor


def run_layer(layer: Attention) -> torch.Tensor:
    q = torch.ones(3, 2 * 4)  # [T, num_heads * head_dim]
    kv = torch.ones(3, 1 * 4)
    return layer(q, kv, kv, batch=None)


def make_layer(backend) -> tuple[ModelContext, Attention]:
    ctx = ModelContext(attn_backend=backend)
    return ctx, Attention(num_heads=2, num_kv_heads=1, head_dim=4, scaling=0.5, layer_id=0, ctx=ctx)


def test_the_layers_read_the_bound_context_and_nothing_stays_bound():
    model_backend, draft = Named(1.0), Named(2.0)
    ctx, layer = make_layer(model_backend)
    context = ctx.context_for(None, attn_backend=draft)
    with ctx.bind(context) as bound:
        assert bound is context and ctx.forward is context and ctx.attn_backend is draft
        assert torch.equal(run_layer(layer), torch.full((3, 8), 2.0))
    assert ctx.forward is None and ctx.attn_backend is model_backend
    assert torch.equal(run_layer(layer), torch.ones(3, 8))
    assert (model_backend.calls, draft.calls) == (1, 1)


def test_an_exception_unbinds_and_forwards_do_not_nest():
    first, second = Named(1.0), Named(2.0)
    ctx, layer = make_layer(first)
    with pytest.raises(RuntimeError, match="forward failed"):
        with ctx.bind(ctx.context_for(None, attn_backend=second)):
            run_layer(layer)
            raise RuntimeError("forward failed")
    assert ctx.forward is None and ctx.attn_backend is first
    with ctx.bind(ctx.context_for(None)):
        with pytest.raises(NestedForwardError, match="do not nest"):
            with ctx.bind(ctx.context_for(None, attn_backend=second)):
                pass  # never reached
        assert ctx.attn_backend is first  # the refused entry changed nothing
    assert ctx.forward is None


def test_a_context_is_frozen_and_its_bindings_read_only():
    context = ForwardContext(batch=None, attn_backend=None, ops=None, bindings={"lora": 1})
    with pytest.raises(AttributeError):
        context.attn_backend = Named(1.0)
    with pytest.raises(TypeError):
        context.bindings["lora"] = 2
    assert context.binding("lora") == 1 and context.binding("other") is None


def test_use_attention_is_deprecated_but_binds_for_the_block():
    model_backend, draft = Named(1.0), Named(2.0)
    ctx, layer = make_layer(model_backend)
    with pytest.warns(DeprecationWarning, match="use_attention is deprecated"):
        with ctx.use_attention(draft) as bound:
            assert bound is draft and torch.equal(run_layer(layer), torch.full((3, 8), 2.0))
    assert ctx.forward is None and ctx.attn_backend is model_backend
