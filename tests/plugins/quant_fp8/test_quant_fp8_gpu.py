"""quant_fp8's CUDA paths against the reference path (the same activation quantization, fp32
dequantized matmul): torch._scaled_mm per tensor and row-wise, the Triton block kernel; odd M."""

from __future__ import annotations

import pytest
import torch

from backplane.plugins.quant_fp8 import quantize as fq
from backplane.plugins.quant_fp8.scheme import Fp8Scheme
from backplane.plugins.quant_fp8.cuda import cuda_linear
from backplane.plugins.quant_fp8.reference import reference_linear

pytestmark = pytest.mark.gpu

SCHEMES = {
    "tensor-static": Fp8Scheme(weights="tensor", activations="tensor", static_input=True),
    "tensor-dynamic": Fp8Scheme(weights="tensor", activations="tensor"),
    "channel-token": Fp8Scheme(weights="channel", activations="token"),
    "block": Fp8Scheme(weights="block", activations="group", block=(128, 128), scale_name="weight_scale_inv"),
}


def _weights(scheme: Fp8Scheme, n: int, k: int):
    w = torch.randn(n, k, device="cuda") * 0.05
    if scheme.weights == "tensor":
        q, s = fq.quantize_per_tensor(w)
    elif scheme.weights == "channel":
        q, s = fq.quantize_weight_per_channel(w)
    else:
        q, s = fq.quantize_weight_blocks(w, *scheme.block)
    return q, s


@pytest.mark.parametrize("name", list(SCHEMES))
@pytest.mark.parametrize("m", [1, 17, 256])
@pytest.mark.parametrize("bias", [False, True])
def test_cuda_path_matches_the_reference(name, m, bias):
    torch.manual_seed(m)
    scheme, n, k = SCHEMES[name], 384, 512
    q, s = _weights(scheme, n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
    input_scale = torch.tensor(0.01, device="cuda") if scheme.static_input else None
    got = cuda_linear(scheme, x, q, s, input_scale, b)
    ref = reference_linear(scheme, x.float(), q, s, input_scale, None if b is None else b.float())
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    # bf16 output: within bf16 rounding of the fp32 reference
    torch.testing.assert_close(got.float(), ref, rtol=1.6e-2, atol=1e-2)
    planted = reference_linear(scheme, x.float(), q, s * 1.01, input_scale, None if b is None else b.float())
    assert not torch.allclose(got.float(), planted, rtol=1e-3, atol=1e-3)


def test_cuda_path_replays_in_a_graph():
    scheme = SCHEMES["channel-token"]
    q, s = _weights(scheme, 256, 256)
    x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
    eager = cuda_linear(scheme, x, q, s, None, None)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cuda_linear(scheme, x, q, s, None, None)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, cuda_linear(scheme, x, q, s, None, None))
    assert not torch.equal(out, eager)
