"""ModelContext.use_attention: the layers run under the bound backend inside the block only; the
previous backend is back on exit, after nested blocks and after an exception."""

from __future__ import annotations

import pytest
import torch

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


def test_the_layers_read_the_bound_backend_and_the_model_backend_comes_back():
    model_backend, draft = Named(1.0), Named(2.0)
    ctx = ModelContext(attn_backend=model_backend)
    layer = Attention(num_heads=2, num_kv_heads=1, head_dim=4, scaling=0.5, layer_id=0, ctx=ctx)
    with ctx.use_attention(draft) as bound:
        assert bound is draft and ctx.attn_backend is draft
        assert torch.equal(run_layer(layer), torch.full((3, 8), 2.0))
    assert ctx.attn_backend is model_backend
    assert torch.equal(run_layer(layer), torch.ones(3, 8))
    assert (model_backend.calls, draft.calls) == (1, 1)


def test_blocks_nest_and_an_exception_restores_the_backend():
    first, second, third = Named(1.0), Named(2.0), Named(3.0)
    ctx = ModelContext(attn_backend=first)
    with ctx.use_attention(second):
        with pytest.raises(RuntimeError, match="draft forward failed"):
            with ctx.use_attention(third):
                assert ctx.attn_backend is third
                raise RuntimeError("draft forward failed")
        assert ctx.attn_backend is second
    assert ctx.attn_backend is first
    bare = ModelContext()  # a draft head's own context starts without a backend, and ends so
    with pytest.raises(ValueError):
        with bare.use_attention(second):
            raise ValueError
    assert bare.attn_backend is None
