"""Under torch.compile the FP8 layer's CUDA path is one opaque op, torch.ops.backplane_fp8.linear.

The CUDA kernels need a GPU; here the op's implementation is pointed at the dequantized reference,
so what is checked is the compile side: a full graph with exactly one op call per layer, the fake
shapes, and the result equal to the eager call.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from backplane.plugins.quant_fp8 import cuda
from backplane.plugins.quant_fp8 import quantize as fq
from backplane.plugins.quant_fp8.method import Fp8LinearMethod
from backplane.plugins.quant_fp8.opaque import fp8_linear, scheme_key
from backplane.plugins.quant_fp8.reference import reference_linear
from backplane.plugins.quant_fp8.scheme import Fp8Scheme

SCHEME = Fp8Scheme(weights="channel", activations="token")


def _layer(n: int = 48, k: int = 32, bias: bool = True):
    torch.manual_seed(0)
    weight, scale = fq.quantize_weight_per_channel(torch.randn(n, k))
    layer = nn.Module()
    layer.weight = nn.Parameter(weight, requires_grad=False)
    layer.weight_scale = nn.Parameter(scale, requires_grad=False)
    method = Fp8LinearMethod(SCHEME, "layer")
    method.use_cuda, method.counters, method.scheme_key = True, None, scheme_key(SCHEME)  # as on a GPU
    return layer, method, (torch.randn(n) if bias else None)


@pytest.fixture
def reference_kernels(monkeypatch):
    calls = []

    def fake_cuda_linear(scheme, x, weight, weight_scale, input_scale, bias, counters=None, source=None):
        calls.append(scheme)
        return reference_linear(scheme, x, weight, weight_scale, input_scale, bias).to(x.dtype)

    monkeypatch.setattr(cuda, "cuda_linear", fake_cuda_linear)
    return calls


def test_compiled_layer_is_one_opaque_call_equal_to_eager(reference_kernels):
    layer, method, bias = _layer()
    x = torch.randn(5, 32)
    eager = method.apply(layer, x, bias)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(lambda t: method.apply(layer, t, bias), backend=backend, fullgraph=True)
    out = compiled(x)
    assert len(graphs) == 1
    targets = [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert targets.count("backplane_fp8.linear") == 1, targets
    torch.testing.assert_close(out, eager)
    assert reference_kernels == [SCHEME, SCHEME]  # eager once, the compiled op once


def test_the_op_checks_out_and_names_an_unknown_scheme(reference_kernels):
    layer, _, bias = _layer()
    x = torch.randn(3, 32)
    # the fake against the real shapes (the schema test multiplies the fp8 inputs, which CPU torch cannot)
    torch.library.opcheck(fp8_linear, (x, layer.weight, layer.weight_scale, None, bias, None, scheme_key(SCHEME)),
                          test_utils=("test_faketensor", "test_autograd_registration"))
    with pytest.raises(RuntimeError, match="unknown scheme 'nope'"):
        fp8_linear(x, layer.weight, layer.weight_scale, None, bias, None, "nope")
