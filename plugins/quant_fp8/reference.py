"""The reference path (CPU, or a GPU without FP8 matmuls): activations quantized exactly as the CUDA
path quantizes them, dequantized, and multiplied by the dequantized weight in fp32."""

from __future__ import annotations

import torch

from backplane.plugins.quant_fp8 import quantize as fq
from backplane.plugins.quant_fp8.scheme import Fp8Scheme


def quantize_input(scheme: Fp8Scheme, x: torch.Tensor, input_scale: torch.Tensor | None):
    """x [M, K] -> (q fp8 [M, K], scale): [] per tensor, [M, 1] per token, [M, K / bk] per group."""
    if scheme.activations == "token":
        return fq.quantize_per_token(x, scheme.activation_scale_ub)
    if scheme.activations == "group":
        return fq.quantize_per_group(x, scheme.block[1])
    return fq.quantize_per_tensor(x, input_scale)


def dequantized_input(scheme: Fp8Scheme, x: torch.Tensor, input_scale: torch.Tensor | None) -> torch.Tensor:
    """x as the FP8 matmul sees it, in fp32: quantized as on the GPU, then dequantized."""
    if scheme.activations == "none":
        return x.float()
    q, scale = quantize_input(scheme, x, input_scale)
    if scheme.activations == "group":
        return fq.dequantize_groups(q, scale)
    return q.float() * scale


def reference_linear(scheme: Fp8Scheme, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     input_scale: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] (model dtype) -> [M, N] in x's dtype: the dequantized product in fp32 (the reference)."""
    w = fq.dequantize_weight(weight, weight_scale, scheme.block if scheme.weights == "block" else None)
    y = dequantized_input(scheme, x, input_scale) @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
