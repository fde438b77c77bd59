"""Quantized experts in the core: the arithmetic every MoE backend shares for an `ExpertQuant`.

Dynamic activation quantization (one scale per row, or per row and run of bk columns), the
dequantized weight of one expert, per-channel or per-block quantization of a layer's experts (online
`--quantization fp8`), and where a layer keeps its scales. Plain torch: any device; the reference
backend and a kernel backend quantize activations with the same function, so on one device they see
the same FP8 inputs. Scales are fp32: scale = max(amax / fp8_max, MIN_SCALE), q = x / scale rounded
to the FP8 dtype (nearest, saturated).
"""

from __future__ import annotations

import torch

from backplane.contracts.quant import ExpertQuant

MIN_SCALE = 1e-12  # an all-zero row or group quantizes to zeros, not NaN


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def _quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., G] -> (q [..., G] in `dtype`, scale [..., 1] fp32): one scale per last-dim run."""
    top = fp8_max(dtype)
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / top).clamp(min=MIN_SCALE)
    return (x.float() / scale).clamp(-top, top).to(dtype), scale


def quantize_activations(x: torch.Tensor, quant: ExpertQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] in quant.weight_dtype, scale fp32): [M, 1] for activations "token",
    [M, K / bk] for "group" (K a multiple of bk)."""
    m, k = x.shape
    if quant.activations == "token":
        return _quantize(x, quant.weight_dtype)
    group = quant.block[1]
    q, scale = _quantize(x.reshape(m, k // group, group), quant.weight_dtype)
    return q.reshape(m, k), scale.reshape(m, k // group)


def dequantize_activations(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [M, K] with scales [M, G] (G = 1: per token) -> fp32 [M, K]."""
    m, k = q.shape
    groups = scale.shape[1]
    return (q.float().reshape(m, groups, k // groups) * scale[:, :, None]).reshape(m, k)


def as_quantized_input(x: torch.Tensor, quant: ExpertQuant) -> torch.Tensor:
    """x [M, K] as an FP8 GEMM sees it, in fp32: quantized per `quant.activations`, dequantized."""
    return dequantize_activations(*quantize_activations(x, quant))


def dequantize_expert(weight: torch.Tensor, scale: torch.Tensor, quant: ExpertQuant) -> torch.Tensor:
    """One expert's weight [N, K] (quant.weight_dtype) and scale ([N] per channel, [N / bn, K / bk]
    per block) -> fp32 [N, K]."""
    if quant.scales == "channel":
        return weight.float() * scale.float()[:, None]
    bn, bk = quant.block
    full = scale.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)
    return weight.float() * full[: weight.shape[0], : weight.shape[1]]


def quantize_experts_per_channel(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked weights [E, N, K] -> (q [E, N, K] in `dtype`, scale [E, N] fp32), expert by expert
    (an fp32 copy of one expert at a time, not of the whole stack)."""
    q = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    scale = torch.empty(weight.shape[:2], dtype=torch.float32, device=weight.device)
    for e in range(weight.shape[0]):
        q[e], s = _quantize(weight[e], dtype)
        scale[e] = s[:, 0]
    return q, scale


def quantize_experts_per_block(weight: torch.Tensor, dtype: torch.dtype,
                               block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked weights [E, N, K] (bn divides N, bk divides K) -> (q [E, N, K] in `dtype`, scale
    [E, N / bn, K / bk] fp32), one scale per (bn, bk) tile, expert by expert."""
    num, n, k = weight.shape
    bn, bk = block
    q = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    scale = torch.empty(num, n // bn, k // bk, dtype=torch.float32, device=weight.device)
    for e in range(num):
        tiles = weight[e].reshape(n // bn, bn, k // bk, bk).permute(0, 2, 1, 3).reshape(n // bn, k // bk, bn * bk)
        qt, s = _quantize(tiles, dtype)  # one scale per tile
        q[e] = qt.reshape(n // bn, k // bk, bn, bk).permute(0, 2, 1, 3).reshape(n, k)
        scale[e] = s[..., 0]
    return q, scale


def expert_scales(layer: torch.nn.Module) -> tuple[ExpertQuant, torch.Tensor, torch.Tensor] | None:
    """(quant, w13 scales, w2 scales) of a layer whose experts are quantized, None for experts in
    the model dtype. The layer says so by `moe_info.quant` (or an `expert_quant` attribute)."""
    info = getattr(layer, "moe_info", None)
    quant = getattr(info, "quant", None) or getattr(layer, "expert_quant", None)
    if quant is None:
        return None
    return quant, getattr(layer, f"w13_{quant.scale_name}"), getattr(layer, f"w2_{quant.scale_name}")
