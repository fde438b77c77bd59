"""FP8 arithmetic shared by every path: quantizing activations and weights, dequantizing them.

The reference path and the CUDA path quantize activations with these same functions, so the CPU
reference differs from the GPU only in the order of the fp32 sums. Shapes: x [M, K] activations,
w [N, K] weights; scales are fp32.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
MIN_SCALE = 1e-12  # an all-zero row or block quantizes to zeros, not NaN


def _to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_per_token(x: torch.Tensor, scale_ub: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] fp8, scale [M, 1]), one dynamic scale per row. scale_ub (fbgemm_fp8's
    activation_scale_ub): each row's max |x| is first clamped to it, so a row reaching beyond it
    saturates at +-448 * scale instead of widening its scale."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    if scale_ub is not None:
        amax = amax.clamp(max=scale_ub)
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    return _to_fp8(x, scale), scale


def quantize_per_tensor(x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x -> (q fp8, scale []) with the given static scale, or a dynamic one from max |x|."""
    if scale is None:
        scale = (x.abs().amax().float() / FP8_MAX).clamp(min=MIN_SCALE)
    scale = scale.float().reshape(())
    return _to_fp8(x, scale), scale


def quantize_per_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of `group`) -> (q [M, K] fp8, scale [M, K / group]): one dynamic scale
    per row and run of `group` columns (the 1x128 activation groups of block-wise FP8)."""
    m, k = x.shape
    grouped = x.reshape(m, k // group, group)
    scale = (grouped.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=MIN_SCALE)
    return _to_fp8(grouped, scale).reshape(m, k), scale.reshape(m, k // group)


def quantize_weight_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q [N, K] fp8, scale [N, 1]): the per-channel layout of compressed-tensors."""
    return quantize_per_token(w)


def quantize_weight_blocks(w: torch.Tensor, block_n: int, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q [N, K] fp8, scale [ceil(N / bn), ceil(K / bk)]), one scale per weight block."""
    n, k = w.shape
    rows, cols = -(-n // block_n), -(-k // block_k)
    padded = torch.zeros(rows * block_n, cols * block_k, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    blocks = padded.reshape(rows, block_n, cols, block_k)
    scale = (blocks.abs().amax(dim=(1, 3)).float() / FP8_MAX).clamp(min=MIN_SCALE)  # [rows, cols]
    q = _to_fp8(blocks, scale[:, None, :, None]).reshape(rows * block_n, cols * block_k)[:n, :k]
    return q.contiguous(), scale


def expand_blocks(scale: torch.Tensor, n: int, k: int, block_n: int, block_k: int) -> torch.Tensor:
    """Block scales [ceil(N / bn), ceil(K / bk)] -> one scale per element [N, K]."""
    return scale.repeat_interleave(block_n, 0).repeat_interleave(block_k, 1)[:n, :k]


def dequantize_weight(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None) -> torch.Tensor:
    """fp8 w [N, K] and its scale (per tensor [] or [1], per channel [N, 1], or blocks) -> fp32 [N, K]."""
    if block is not None:
        scale = expand_blocks(scale.float(), w.shape[0], w.shape[1], *block)
    return w.float() * scale.float()


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [M, K] fp8 with group scales [M, G] -> fp32 [M, K]."""
    m, k = q.shape
    groups = scale.shape[-1]
    return (q.float().reshape(m, groups, k // groups) * scale.float()[:, :, None]).reshape(m, k)
