"""The decode LoRA kernel: shrink and expand of one projection group in a single launch.

One program per (adapter slot, column span). It finds its slot's tokens in the batch's per-token
slot vector (`LoraBatchInfo.token_slots`, a persistent device buffer), computes their rank-R
shrink for the slice its columns belong to, x[tokens] @ A_j[slot]^T, in registers, and adds
scaling * y @ B[slot, span]^T into the base output. No host plan, no intermediate tensor, one launch
per projection group; the grid depends only on the weight shapes, so it is graph-safe as is.

The shrink is recomputed by every column span of a slot (A is re-read from L2), and every program
works on all BLOCK_T token rows (masked), so this layout is for decode-sized batches:
`FUSED_MAX_TOKENS` tokens at most. Larger batches use the segmented kernels of kernels.py.

Registered as the torch custom op `backplane_lora_triton::fused_shrink_expand` (in place into
`out`) for torch.compile; eager callers and graph captures launch the kernel directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

FUSED_MAX_TOKENS = 64  # BLOCK_T rows per program; beyond this the segmented kernels win


@triton.jit
def _fused_kernel(
    x_ptr, a_ptr, b_ptr, out_ptr, token_slots_ptr, ranks_ptr, scalings_ptr,
    num_tokens, K, r_max, off1, off2, off3,
    stride_xm, stride_xk, stride_as, stride_an, stride_ak, stride_bs, stride_bn, stride_bk,
    stride_om, stride_on,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    SPAN: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # x: [T, K]; a: [num_slots, num_slices * r_max, K]; b: [num_slots, off3, r_max]; out: [T, off3].
    # Slice j owns columns [off_j, off_j+1) (off0 = 0) and the cdiv(width_j, SPAN) consecutive
    # programs along axis 1 that cover them, SPAN = BLOCK_N * sub-blocks columns each.
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    rank = tl.load(ranks_ptr + slot)
    if rank == 0:  # the base-only slot, or a free one
        return
    offs_t = tl.arange(0, BLOCK_T)
    token_slot = tl.load(token_slots_ptr + offs_t, mask=offs_t < num_tokens, other=-1)
    t_mask = token_slot == slot
    if tl.max(t_mask.to(tl.int32), axis=0) == 0:  # no token of the batch uses this slot
        return
    first1 = tl.cdiv(off1, SPAN)
    first2 = first1 + tl.cdiv(off2 - off1, SPAN)
    j = (pid_n >= first1).to(tl.int32) + (pid_n >= first2).to(tl.int32)
    first = tl.where(j == 0, 0, tl.where(j == 1, first1, first2))
    col_begin = tl.where(j == 0, 0, tl.where(j == 1, off1, off2))
    col_end = tl.where(j == 0, off1, tl.where(j == 1, off2, off3))
    span_begin = col_begin + (pid_n - first) * SPAN
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    rows = offs_t.to(tl.int64)
    y = _shrink_rows(x_ptr + rows[:, None] * stride_xm, t_mask,
                     a_ptr + slot.to(tl.int64) * stride_as + (j * r_max + offs_r)[None, :] * stride_an,
                     r_mask, K, stride_xk, stride_ak, BLOCK_T, BLOCK_R, BLOCK_K, PRECISION)
    scaling = tl.load(scalings_ptr + slot)
    b_rows = b_ptr + slot.to(tl.int64) * stride_bs + offs_r[:, None] * stride_bk
    out_rows = out_ptr + rows[:, None] * stride_om
    for n in tl.static_range(0, SPAN, BLOCK_N):
        offs_n = span_begin + n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < col_end
        b = tl.load(b_rows + offs_n[None, :] * stride_bn, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        delta = tl.dot(y.to(b.dtype), b, input_precision=PRECISION)  # [BLOCK_T, BLOCK_N]
        out_ptrs = out_rows + offs_n[None, :] * stride_on
        mask = t_mask[:, None] & n_mask[None, :]
        base = tl.load(out_ptrs, mask=mask, other=0.0)
        tl.store(out_ptrs, (base.to(tl.float32) + delta * scaling).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _shrink_rows(x_rows, t_mask, a_cols, r_mask, K, stride_xk, stride_ak,
                 BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """y [BLOCK_T, BLOCK_R] float32 = x[rows] @ A^T over all of K; masked rows and ranks read nothing."""
    offs_k = tl.arange(0, BLOCK_K)
    y = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        kk = k + offs_k
        k_mask = kk < K
        x = tl.load(x_rows + kk[None, :] * stride_xk, mask=t_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_cols + kk[:, None] * stride_ak, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        y += tl.dot(x.to(a.dtype), a, input_precision=PRECISION)
    return y


def _pow2_between(value: int, low: int, high: int) -> int:
    return max(low, min(high, triton.next_power_of_2(value)))


def choose_span(width: int, num_slots: int, r_max: int) -> int:
    """Output columns per program: wide enough that A, re-read by every span of a slot, is not read
    much more often than B, and about one program per SM when every slot is in the batch."""
    span = triton.next_power_of_2(max(1, width * num_slots // 128))
    return max(128, min(1024 if r_max <= 32 else 512, span))


@dataclass(frozen=True)
class FusedConfig:
    """Launch settings of the fused kernel (0: automatic)."""

    span: int = 0
    block_k: int = 0
    num_warps: int = 0
    num_stages: int = 3


def launch(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, token_slots: torch.Tensor,
    ranks: torch.Tensor, scalings: torch.Tensor, offsets: list[int], config: FusedConfig = FusedConfig(),
) -> None:  # fmt: skip
    """out[t, slice j] += scaling[slot(t)] * (x[t] A_j[slot(t)]^T) B_j[slot(t)]^T for t < T, in place.

    x: [T, K] with T <= FUSED_MAX_TOKENS; a: [num_slots, num_slices * r_max, K]; b: [num_slots, N,
    r_max]; out: [T, N]; token_slots: int32, the slot of each token (rows beyond its length are not
    covered); ranks [num_slots] int32; scalings [num_slots] float32; offsets: num_slices + 1 (1 to 3)
    host ints from 0 to N.
    """
    (num_tokens, k), (num_slots, _, r_max) = x.shape, b.shape
    if num_tokens > FUSED_MAX_TOKENS:
        raise ValueError(f"fused LoRA kernel: expected at most {FUSED_MAX_TOKENS} tokens, got {num_tokens}")
    if num_tokens == 0:
        return
    width = offsets[-1]
    block_t = _pow2_between(num_tokens, 16, FUSED_MAX_TOKENS)
    block_r = _pow2_between(r_max, 16, 128)
    block_n = 64 if block_r > 32 else 128
    span = max(config.span or choose_span(width, num_slots, r_max), block_n)
    # A tiles of 8-16 KB per stage keep enough of the shrink's loads in flight per program
    block_k = config.block_k or (256 if block_r <= 32 else 128 if block_r <= 64 else 64)
    num_warps = config.num_warps or (8 if block_t * block_k >= 64 * 128 else 4)
    bounds = list(offsets[1:]) + [offsets[-1]] * (4 - len(offsets))  # pad to (off1, off2, off3)
    num_spans = sum(triton.cdiv(hi - lo, span) for lo, hi in zip(offsets, offsets[1:]))
    precision = "ieee" if a.dtype == torch.float32 else "tf32"  # ignored for 16-bit operands
    _fused_kernel[(num_slots, num_spans)](
        x, a, b, out, token_slots, ranks, scalings,
        min(num_tokens, token_slots.numel()), k, r_max, bounds[0], bounds[1], bounds[2],
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2),
        b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1),
        BLOCK_T=block_t, BLOCK_R=block_r, BLOCK_K=block_k, BLOCK_N=block_n, SPAN=span,
        PRECISION=precision, num_warps=num_warps, num_stages=config.num_stages,
    )  # fmt: skip


@torch.library.custom_op("backplane_lora_triton::fused_shrink_expand", mutates_args=("out",))
def fused_shrink_expand_op(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, token_slots: torch.Tensor,
    ranks: torch.Tensor, scalings: torch.Tensor, offsets: list[int], config: list[int],
) -> None:  # fmt: skip
    """config: the FusedConfig fields in order (span, block_k, num_warps, num_stages)."""
    launch(x, a, b, out, token_slots, ranks, scalings, offsets, FusedConfig(*config))


@fused_shrink_expand_op.register_fake
def _fused_shrink_expand_fake(x, a, b, out, token_slots, ranks, scalings, offsets, config) -> None:
    return None  # in place into `out`: no new tensor


def fused_shrink_expand(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, token_slots: torch.Tensor,
    ranks: torch.Tensor, scalings: torch.Tensor, offsets: list[int], config: FusedConfig = FusedConfig(),
) -> torch.Tensor:  # fmt: skip
    """`launch`, through the custom op while torch.compile traces, directly otherwise; returns out."""
    if torch.compiler.is_compiling():
        fields = [config.span, config.block_k, config.num_warps, config.num_stages]
        torch.ops.backplane_lora_triton.fused_shrink_expand(
            x, a, b, out, token_slots, ranks, scalings, list(offsets), fields
        )
    else:
        launch(x, a, b, out, token_slots, ranks, scalings, list(offsets), config)
    return out
