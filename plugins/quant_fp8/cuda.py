"""The CUDA paths: torch._scaled_mm for per-tensor and row-wise scales, the Triton kernel for
block scales (kernels.py). Activations are quantized by the same functions as the reference.

  per-tensor weight, per-tensor activations: _scaled_mm with two scalar scales (any output dtype)
  per-channel or per-tensor weight, per-token or per-tensor activations: _scaled_mm row-wise
    (scale_a [M, 1], scale_b [1, N]), bf16 output only
  block weight, 1 x bk activation groups: the Triton kernel, scales applied per K block
  anything else (weight-only, row-wise with an fp16/fp32 model): the dequantizing reference
"""

from __future__ import annotations

import torch

from backplane.plugins.quant_fp8.reference import quantize_input, reference_linear
from backplane.plugins.quant_fp8.scheme import Fp8Scheme


def cuda_linear(scheme: Fp8Scheme, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                input_scale: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] in the model dtype -> [M, N] in the same dtype. weight [N, K] fp8 (row-major)."""
    if scheme.weights == "block" and scheme.activations == "group":
        from backplane.plugins.quant_fp8.kernels import block_fp8_matmul

        q, x_scale = quantize_input(scheme, x, None)
        y = block_fp8_matmul(q, x_scale, weight, weight_scale, scheme.block, x.dtype)
        return y if bias is None else y + bias
    if scheme.activations == "tensor" and scheme.weights == "tensor":
        q, x_scale = quantize_input(scheme, x, input_scale)
        return torch._scaled_mm(q, weight.t(), scale_a=x_scale, scale_b=weight_scale.float(), bias=bias,
                                out_dtype=x.dtype)
    if scheme.activations in ("token", "tensor") and scheme.weights in ("channel", "tensor") and x.dtype == torch.bfloat16:
        return _rowwise(scheme, x, weight, weight_scale, input_scale, bias)
    return reference_linear(scheme, x, weight, weight_scale, input_scale, bias)


def _rowwise(scheme: Fp8Scheme, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             input_scale: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """_scaled_mm with row-wise scales: scale_a [M, 1] per token, scale_b [1, N] per output channel."""
    m, n = x.shape[0], weight.shape[0]
    q, x_scale = quantize_input(scheme, x, input_scale)
    scale_a = x_scale.float().reshape(-1, 1).expand(m, 1).contiguous()
    scale_b = weight_scale.float().reshape(1, -1).expand(1, n).contiguous()  # [N, 1] or [] -> [1, N]
    y = torch._scaled_mm(q, weight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
    return y if bias is None else y + bias
