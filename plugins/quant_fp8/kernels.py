"""Triton kernel: the block-scaled FP8 matmul of block-wise FP8 checkpoints.

y[m, n] = sum over K blocks kb of (sum_k a[m, k] * b[n, k]) * a_scale[m, kb] * b_scale[n // bn, kb]:
each K step of the loop is one weight block's columns, so both scales are applied once per K step in
fp32. One program computes a BLOCK_M x BLOCK_N tile; BLOCK_N divides the weight block's rows (one
weight-scale row per tile), BLOCK_K equals its columns. Shapes: a [M, K] fp8 row-major, a_scale
[M, K / bk] fp32, b [N, K] fp8 row-major, b_scale [ceil(N / bn), K / bk] fp32 -> y [M, N].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _block_fp8_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, y_ptr, M, N, K, stride_am, stride_asm, stride_bn, stride_bsn,
                      stride_ym, BLOCK_N_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_rows, b_rows = a_ptr + rm[:, None] * stride_am, b_ptr + rn[None, :] * stride_bn
    scale_row = bs_ptr + (rn // BLOCK_N_SCALE) * stride_bsn  # [BLOCK_N]: the weight block row of each column
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + rk
        a = tl.load(a_rows + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
        b = tl.load(b_rows + k[:, None], mask=(rn[None, :] < N) & (k[:, None] < K), other=0.0)
        a_s = tl.load(as_ptr + rm * stride_asm + kb, mask=rm < M, other=0.0)
        b_s = tl.load(scale_row + kb, mask=rn < N, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y, mask=(rm[:, None] < M) & (rn[None, :] < N))


def block_fp8_matmul(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                     block: tuple[int, int], out_dtype: torch.dtype) -> torch.Tensor:
    """a [M, K] fp8, a_scale [M, K / bk], b [N, K] fp8, b_scale [ceil(N / bn), K / bk] -> [M, N] out_dtype."""
    block_n, block_k = block
    m, k = a.shape
    n = b.shape[0]
    y = torch.empty(m, n, dtype=out_dtype, device=a.device)
    tile_n = min(block_n, 128)
    while block_n % tile_n:
        tile_n //= 2
    tile_m = 16 if m <= 16 else 64
    grid = (triton.cdiv(m, tile_m), triton.cdiv(n, tile_n))
    a_scale, b_scale = a_scale.contiguous(), b_scale.contiguous()
    _block_fp8_kernel[grid](a, a_scale, b, b_scale, y, m, n, k, a.stride(0), a_scale.stride(0), b.stride(0),
                            b_scale.stride(0), y.stride(0), BLOCK_N_SCALE=block_n, BLOCK_M=tile_m, BLOCK_N=tile_n,
                            BLOCK_K=block_k)
    return y
