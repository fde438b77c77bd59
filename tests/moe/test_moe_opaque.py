"""moe_experts: the layer's MoE backend directly in eager mode, and through the opaque op
torch.ops.backplane.moe_experts while torch.compile traces (no graph break although the
torch_native backend syncs with the host; equal to eager; the fake gives the shape)."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch

from backplane.moe import TorchNativeMoeBackend, moe_experts, moe_reference, register_moe_layer, route

NUM_EXPERTS, TOP_K, HIDDEN, INTER = 8, 2, 32, 16


class CountingBackend(TorchNativeMoeBackend):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def apply(self, layer, x, topk_weights, topk_ids):
        self.calls += 1
        return super().apply(layer, x, topk_weights, topk_ids)


class TinyMoe(torch.nn.Module):
    """A layer as FusedMoE looks to the backend: stacked expert weights, a ctx, a handle."""

    def __init__(self, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.gate = torch.nn.Parameter(torch.randn(NUM_EXPERTS, HIDDEN, generator=gen), requires_grad=False)
        self.w13_weight = torch.nn.Parameter(torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5,
                                             requires_grad=False)
        self.w2_weight = torch.nn.Parameter(torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=gen) / INTER**0.5,
                                            requires_grad=False)
        self.ctx = SimpleNamespace(moe_backend=CountingBackend())
        self.handle = register_moe_layer(self)

    def forward(self, x):
        weights, ids = route(x @ self.gate.t(), TOP_K, renormalize=True)
        return moe_experts(self, x, weights, ids) * 2.0


def _want(layer, x):
    weights, ids = route(x @ layer.gate.t(), TOP_K, True)
    return moe_reference(x, layer.w13_weight, layer.w2_weight, weights, ids) * 2.0


def test_eager_calls_the_backend_directly():
    layer = TinyMoe()
    x = torch.randn(5, HIDDEN)
    torch.testing.assert_close(layer(x), _want(layer, x))
    assert layer.ctx.moe_backend.calls == 1


def test_compiled_forward_keeps_one_opaque_call_and_equals_eager():
    layer = TinyMoe(seed=1)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(layer, backend=backend, fullgraph=True, dynamic=True)  # a sync would break fullgraph
    for num_tokens in (3, 7):
        x = torch.randn(num_tokens, HIDDEN)
        torch.testing.assert_close(compiled(x), _want(layer, x))
    targets = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count("backplane.moe_experts") == len(graphs) == 1, targets
    assert layer.ctx.moe_backend.calls == 2


def test_aot_autograd_traces_through_the_fake():
    layer = TinyMoe(seed=2)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, HIDDEN)
    torch.testing.assert_close(compiled(x), _want(layer, x))


def test_the_op_passes_torch_library_opcheck():
    layer = TinyMoe(seed=3)
    x = torch.randn(6, HIDDEN)
    weights, ids = route(x @ layer.gate.t(), TOP_K, True)
    torch.library.opcheck(torch.ops.backplane.moe_experts.default, (x, weights, ids, layer.handle),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def test_handles_are_unique_and_held_weakly():
    first, second = TinyMoe(), TinyMoe()
    assert first.handle != second.handle
    handle = second.handle
    del second
    gc.collect()
    x = torch.randn(2, HIDDEN)
    weights, ids = route(x @ first.gate.t(), TOP_K, True)
    with pytest.raises(RuntimeError, match=rf"no live layer with handle {handle}$"):
        torch.ops.backplane.moe_experts(x, weights, ids, handle)


def test_routing_of_the_wrong_dtype_is_one_line():
    layer = TinyMoe()
    x = torch.randn(2, HIDDEN)
    weights, ids = route(x @ layer.gate.t(), TOP_K, True)
    with pytest.raises(ValueError, match=r"^moe_experts: expected topk_weights float32 and topk_ids int32 \(as "
                                         r"backplane.moe.route returns\), got torch.bfloat16 and torch.int64$"):
        moe_experts(layer, x, weights.bfloat16(), ids.long())
