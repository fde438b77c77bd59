"""The expand of a folded LoRA pass: out = base + scaling * shrink B^T, in one launch.

With the shrink folded into the base GEMM (`LoraBackend.folds_shrink`), the layer computes
y = x @ [W; A]^T, where A stacks every adapter slot's rows under the base weight W, so y holds the
base output in its first N columns and, after them, every slot's rank-R shrink of x. What is left
per token t is its own slot's part:

    out[t, n] = y[t, n] + scaling[slot] * sum_r y[t, N + (slot * S + j(n)) * R + r] * B[slot, n, r]

with j(n) the slice (q/k/v, gate/up) that column n belongs to. One program owns one token and a
span of BLOCK_N columns: it reads its token's slot, that slot's B rows for the span and the few
shrink values, and writes the span of a fresh contiguous output (the base columns of y are strided).
The grid is (tokens, N / BLOCK_N): it depends on shapes only, so the launch can be captured in a
CUDA graph, and the per-token slots are read on the device (batch_info.token_slots).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

MAX_SLICES = 3  # q/k/v


@triton.jit
def _folded_expand_kernel(
    Y, B, Out, Token_slots, Scalings,
    num_base, off1, off2,
    stride_y, stride_bs, stride_bn, stride_o,
    NUM_SLICES: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < num_base
    row = Y + t.to(tl.int64) * stride_y
    base = tl.load(row + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    slot = tl.load(Token_slots + t)
    if slot != 0:  # slot 0 (base only, padding) has zero A: nothing to add
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        # the token's shrink for its slot, one [BLOCK_R] vector per slice; each column takes its slice's
        first = row + num_base + slot.to(tl.int64) * (NUM_SLICES * R)
        shrunk = tl.load(first + offs_r, mask=mask_r, other=0.0).to(tl.float32)[None, :]  # [1, BLOCK_R]
        if NUM_SLICES > 1:
            second = tl.load(first + R + offs_r, mask=mask_r, other=0.0).to(tl.float32)[None, :]
            shrunk = tl.where((offs_n >= off1)[:, None], second, shrunk)  # [BLOCK_N, BLOCK_R]
        if NUM_SLICES > 2:
            third = tl.load(first + 2 * R + offs_r, mask=mask_r, other=0.0).to(tl.float32)[None, :]
            shrunk = tl.where((offs_n >= off2)[:, None], third, shrunk)
        b = tl.load(B + slot.to(tl.int64) * stride_bs + offs_n[:, None].to(tl.int64) * stride_bn + offs_r[None, :],
                    mask=mask_n[:, None] & mask_r[None, :], other=0.0).to(tl.float32)
        base += tl.sum(shrunk * b, axis=1) * tl.load(Scalings + slot)
    tl.store(Out + t.to(tl.int64) * stride_o + offs_n, base.to(Out.dtype.element_ty), mask=mask_n)


INTERPRETED_MAX_BLOCK_N = 1024


def choose_block_n(num_base: int, device: torch.device | None = None) -> int:
    """Columns per program: on CUDA enough programs for a single token to spread over the SMs; on
    CPU (the Triton interpreter, which runs each program in Python) one program per token for the
    small widths tests use, up to INTERPRETED_MAX_BLOCK_N columns."""
    if device is not None and device.type == "cpu":
        return min(max(64, triton.next_power_of_2(num_base)), INTERPRETED_MAX_BLOCK_N)
    return 64 if num_base <= 4096 else 128


def folded_expand(
    y: torch.Tensor,
    num_base: int,
    b_weights: torch.Tensor,
    output_offsets: Sequence[int],
    out: torch.Tensor,
    token_slots: torch.Tensor,
    scalings: torch.Tensor,
    block_n: int | None = None,
) -> torch.Tensor:
    """out[t] = y[t, :num_base] + scaling[slot] * shrink B^T (see the module docstring); returns out.

    y: [T, num_base + num_slots * num_slices * R] with unit column stride; b_weights: [num_slots,
    num_base, R] contiguous in R; output_offsets: num_slices + 1 ints from 0 to num_base; out:
    [T, num_base] with unit column stride; token_slots: [>= T] int32; scalings: [num_slots] fp32.
    """
    offsets = [int(v) for v in output_offsets]
    num_slices = len(offsets) - 1
    num_slots, n, r = b_weights.shape
    num_tokens = y.shape[0]
    if not 1 <= num_slices <= MAX_SLICES or offsets[0] != 0 or offsets[-1] != num_base or n != num_base:
        raise ValueError(f"folded_expand: expected 2 to {MAX_SLICES + 1} offsets from 0 to num_base={num_base} "
                         f"and B of {num_base} rows, got offsets {offsets} and B of shape {tuple(b_weights.shape)}")
    if y.shape[1] != num_base + num_slots * num_slices * r:
        raise ValueError(f"folded_expand: expected y of {num_base + num_slots * num_slices * r} columns (N + "
                         f"slots x slices x rank), got {y.shape[1]}")
    if y.stride(1) != 1 or out.stride(1) != 1 or b_weights.stride(2) != 1 or out.shape != (num_tokens, num_base):
        raise ValueError("folded_expand: y, out and B need unit last strides and out [T, num_base]")
    if num_tokens == 0:
        return out
    block_n = block_n or choose_block_n(num_base, y.device)
    grid = (num_tokens, triton.cdiv(num_base, block_n))
    _folded_expand_kernel[grid](
        y, b_weights, out, token_slots, scalings,
        num_base, offsets[1] if num_slices > 1 else 0, offsets[2] if num_slices > 2 else 0,
        y.stride(0), b_weights.stride(0), b_weights.stride(1), out.stride(0),
        NUM_SLICES=num_slices, R=r, BLOCK_R=max(16, triton.next_power_of_2(r)), BLOCK_N=block_n,
        num_warps=4,
    )
    return out
