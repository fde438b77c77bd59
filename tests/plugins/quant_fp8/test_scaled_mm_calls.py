"""cuda.py's torch._scaled_mm calls, on CPU: torch._scaled_mm is replaced by a stand-in that refuses
what CUDA's _scaled_mm refuses (aten/src/ATen/native/cuda/Blas.cpp: a row-major first operand, a
column-major second, K and N multiples of 16, fp32 scales, scalar or row-wise [M, 1] / [1, N] scales,
row-wise output bf16 only, no bias with an fp32 output, a bias in the output's 16-bit dtype) and
otherwise computes the dequantized product, so each call site's arguments are checked without a GPU."""

from __future__ import annotations

import pytest
import torch

from backplane.plugins.quant_fp8 import cuda
from backplane.plugins.quant_fp8 import quantize as fq
from backplane.plugins.quant_fp8.reference import reference_linear
from backplane.plugins.quant_fp8.scheme import Fp8Scheme


def cuda_scaled_mm(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
    """torch._scaled_mm's contract on CUDA (tensor-wise and row-wise scaling), computed in fp32."""
    out_dtype = out_dtype or a.dtype
    (m, k), n = a.shape, b.shape[1]
    assert a.dtype == b.dtype == fq.FP8, (a.dtype, b.dtype)
    assert a.stride(1) == 1 and a.stride(0) >= k, f"a must be row-major, got stride {a.stride()}"
    assert b.stride(0) == 1 and b.stride(1) >= k, f"b must be column-major, got stride {b.stride()}"
    assert k % 16 == 0 and n % 16 == 0, f"K {k} and N {n} must be multiples of 16"
    assert scale_a.dtype == scale_b.dtype == torch.float32, (scale_a.dtype, scale_b.dtype)
    rowwise = scale_a.numel() != 1 or scale_b.numel() != 1
    if rowwise:
        assert tuple(scale_a.shape) == (m, 1) and tuple(scale_b.shape) == (1, n), (scale_a.shape, scale_b.shape)
        assert scale_a.is_contiguous() and scale_b.is_contiguous()
        assert out_dtype == torch.bfloat16, f"row-wise scaling gives bf16 only, got {out_dtype}"
    if bias is not None:
        assert out_dtype != torch.float32, "Bias is not supported when out_dtype is set to Float32"
        assert bias.dtype == out_dtype and bias.numel() == n, (bias.dtype, out_dtype, bias.shape)
    y = (a.float() @ b.float()) * scale_a.float().reshape(-1, 1) * scale_b.float().reshape(1, -1)
    return (y if bias is None else y + bias.float()).to(out_dtype)


@pytest.fixture
def on_cuda_terms(monkeypatch):
    monkeypatch.setattr(torch, "_scaled_mm", cuda_scaled_mm)


TENSOR = {"static": Fp8Scheme(weights="tensor", activations="tensor", static_input=True),
          "dynamic": Fp8Scheme(weights="tensor", activations="tensor")}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("name", list(TENSOR))
@pytest.mark.parametrize("bias", [False, True])
def test_the_per_tensor_call_is_one_cuda_accepts(on_cuda_terms, dtype, name, bias):
    """Per-tensor weights and activations (ModelOpt FP8, compressed-tensors per tensor) in every model
    dtype, with and without a bias (an fp32 model adds it after the product)."""
    scheme, gen = TENSOR[name], torch.Generator().manual_seed(0)
    q_w, s_w = fq.quantize_per_tensor(torch.randn(48, 64, generator=gen) * 0.05)
    x = torch.randn(5, 64, generator=gen).to(dtype)
    b = torch.randn(48, generator=gen).to(dtype) if bias else None
    input_scale = torch.tensor(0.01) if scheme.static_input else None
    got = cuda.cuda_linear(scheme, x, q_w, s_w, input_scale, b)
    assert got.dtype == dtype and got.shape == (5, 48)
    want = reference_linear(scheme, x, q_w, s_w, input_scale, b)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("name, scheme", [("token", Fp8Scheme(weights="channel", activations="token")),
                                          ("token-bound", Fp8Scheme(weights="channel", activations="token",
                                                                    activation_scale_ub=0.5)),
                                          ("static", Fp8Scheme(weights="channel", activations="tensor",
                                                               static_input=True)),
                                          ("tensor-weight", Fp8Scheme(weights="tensor", activations="token"))])
def test_the_rowwise_call_is_one_cuda_accepts(on_cuda_terms, name, scheme):
    """_rowwise (bf16 models above the decode sizes): scale_a [M, 1], scale_b [1, N], bf16 out."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(48, 64, generator=gen) * 0.05
    q_w, s_w = fq.quantize_per_tensor(w) if scheme.weights == "tensor" else fq.quantize_weight_per_channel(w)
    x = torch.randn(70, 64, generator=gen).to(torch.bfloat16)
    b = torch.randn(48, generator=gen).to(torch.bfloat16)
    input_scale = torch.tensor(0.01) if scheme.static_input else None
    got = cuda._rowwise(scheme, x, q_w, s_w, input_scale, b)
    assert got.dtype == torch.bfloat16 and got.shape == (70, 48)
    want = reference_linear(scheme, x.float(), q_w, s_w, input_scale, b.float())
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_the_stand_in_refuses_what_cuda_refuses():
    """The stand-in sees each kind of call CUDA refuses (so the tests above can fail)."""
    a = torch.zeros(4, 32).to(fq.FP8)
    w = torch.zeros(16, 32).to(fq.FP8)
    one = torch.tensor(1.0)
    bad = [dict(a=a, b=w.contiguous().t().contiguous(), scale_a=one, scale_b=one),  # b row-major
           dict(a=a, b=w.t(), scale_a=one, scale_b=one, bias=torch.zeros(16), out_dtype=torch.float32),
           dict(a=a, b=w.t(), scale_a=torch.ones(4, 1), scale_b=torch.ones(1, 16), out_dtype=torch.float16),
           dict(a=a, b=w.t(), scale_a=one.double(), scale_b=one)]
    for kwargs in bad:
        with pytest.raises(AssertionError):
            cuda_scaled_mm(**kwargs)
