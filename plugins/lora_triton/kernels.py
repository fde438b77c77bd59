"""Triton segmented-GEMM kernels for LoRA: shrink (x A^T) and expand (+ scaling * y B^T).

Both kernels run one program per (tile, column block[, K split]) of a TilePlan (see plan.py): a tile
is up to BLOCK_M tokens of one adapter slot, gathered through `perm`. Tiles with no tokens exit at
once, so the grid can be a fixed upper bound (graph-safe). Ranks are masked: weight rows or columns
at or beyond the slot's rank are never read, and a base-only slot (rank 0) reads no weights at all.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _load_tile(tiles_ptr, perm_ptr, tile, BLOCK_M: tl.constexpr):
    """(slot, rows [BLOCK_M] int64, row mask [BLOCK_M], number of tokens) of one tile."""
    slot = tl.load(tiles_ptr + 3 * tile)
    start = tl.load(tiles_ptr + 3 * tile + 1)
    length = tl.load(tiles_ptr + 3 * tile + 2)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < length
    rows = tl.load(perm_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
    return slot, rows, m_mask, length


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, y_ptr, ws_ptr, locks_ptr, tiles_ptr, perm_ptr, ranks_ptr,
    K, r_max, n_out, k_per_split,
    stride_xm, stride_xk, stride_as, stride_an, stride_ak, stride_ym, stride_yn, stride_ws,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # x: [T, K]; a: [num_slots, n_out, K] with n_out = num_slices * r_max; y: [T, n_out] float32
    # ws: [SPLIT_K, T, n_out] float32 partial sums (y's strides); locks: [>= tiles * col blocks] int32, zero
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    slot, rows, m_mask, length = _load_tile(tiles_ptr, perm_ptr, tile, BLOCK_M)
    if length == 0:  # beyond the batch's tiles
        return
    rank = tl.load(ranks_ptr + slot)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_out_mask = offs_n < n_out
    n_mask = n_out_mask & (offs_n % r_max < rank)  # row r of slice j is valid iff r < rank
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(K, k_begin + k_per_split)
    # no valid weight row in this column block (rank 0, say): skip every load, store zeros
    k_end = tl.where(tl.max(n_mask.to(tl.int32), axis=0) > 0, k_end, k_begin)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm
    a_ptrs = a_ptr + slot.to(tl.int64) * stride_as + offs_n[None, :] * stride_an
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_begin, k_end, BLOCK_K):
        kk = k + offs_k
        k_mask = kk < k_end
        x = tl.load(x_ptrs + kk[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_ptrs + kk[:, None] * stride_ak, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += tl.dot(x.to(a.dtype), a, input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
    offs_y = rows[:, None] * stride_ym + offs_n[None, :] * stride_yn
    mask = m_mask[:, None] & n_out_mask[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptr + offs_y, acc, mask=mask)
    else:
        # Serial split-K: every split stores its partial sum; the last to arrive adds them all up
        # into y and re-arms the lock for the next launch (so y needs no zeroing kernel).
        tl.store(ws_ptr + pid_k * stride_ws + offs_y, acc, mask=mask)
        tl.debug_barrier()  # NOTE: all threads' stores happen before the release below
        lock = locks_ptr + tile * tl.num_programs(1) + pid_n
        if tl.atomic_add(lock, 1, sem="acq_rel") == SPLIT_K - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for split in tl.static_range(SPLIT_K):
                total += tl.load(ws_ptr + split * stride_ws + offs_y, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + offs_y, total, mask=mask)
            tl.atomic_xchg(lock, 0)


@triton.jit
def _expand_kernel(
    x_ptr, b_ptr, out_ptr, tiles_ptr, perm_ptr, ranks_ptr, scalings_ptr,
    r_max, off1, off2, off3,
    stride_xm, stride_xk, stride_bs, stride_bn, stride_bk, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # x: [T, num_slices * r_max]; b: [num_slots, off3, r_max]; out: [T, off3], updated in place.
    # Slice j (x columns j*r_max..) owns output columns [off_j, off_j+1), off0 = 0, and the
    # cdiv(off_j+1 - off_j, BLOCK_N) consecutive column-block programs that cover them.
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot, rows, m_mask, length = _load_tile(tiles_ptr, perm_ptr, tile, BLOCK_M)
    if length == 0:  # beyond the batch's tiles
        return
    rank = tl.load(ranks_ptr + slot)
    if rank == 0:
        return
    first1 = tl.cdiv(off1, BLOCK_N)
    first2 = first1 + tl.cdiv(off2 - off1, BLOCK_N)
    j = (pid_n >= first1).to(tl.int32) + (pid_n >= first2).to(tl.int32)
    first = tl.where(j == 0, 0, tl.where(j == 1, first1, first2))
    col_begin = tl.where(j == 0, 0, tl.where(j == 1, off1, off2))
    col_end = tl.where(j == 0, off1, tl.where(j == 1, off2, off3))
    offs_n = col_begin + (pid_n - first) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < col_end
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + (j * r_max) * stride_xk
    b_ptrs = b_ptr + slot.to(tl.int64) * stride_bs + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, rank, BLOCK_K):
        kk = k + offs_k
        k_mask = kk < rank
        x = tl.load(x_ptrs + kk[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs + kk[:, None] * stride_bk, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += tl.dot(x.to(b.dtype), b, input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
    scaling = tl.load(scalings_ptr + slot)
    out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
    mask = m_mask[:, None] & n_mask[None, :]
    base = tl.load(out_ptrs, mask=mask, other=0.0)
    result = base.to(tl.float32) + acc * scaling
    tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=mask)


def _precision(dtype: torch.dtype) -> str:
    # float32 operands stay exact ("ieee"); the setting is ignored for 16-bit operands
    return "ieee" if dtype == torch.float32 else "tf32"


def shrink(
    x: torch.Tensor, a: torch.Tensor, tiles: torch.Tensor, perm: torch.Tensor, ranks: torch.Tensor,
    locks: torch.Tensor, num_tiles: int, r_max: int, *, block_m: int, block_n: int, block_k: int,
    split_k: int, num_warps: int = 4, num_stages: int = 3,
) -> torch.Tensor:  # fmt: skip
    """y[perm rows] = x @ a[slot]^T per tile, rank-masked; returns y [T, n_out] float32.

    x: [T, K]; a: [num_slots, n_out, K]; tiles/perm: a TilePlan's buffers; locks: int32 zeros with
    at least num_tiles * cdiv(n_out, block_n) entries, left zero again (used when split_k > 1).
    NOTE: launches that share `locks` must not run concurrently (one stream).
    """
    (num_tokens, K), n_out = x.shape, a.shape[1]
    num_col_blocks = triton.cdiv(n_out, block_n)
    assert split_k == 1 or locks.numel() >= num_tiles * num_col_blocks, "shrink: locks buffer too small"
    y = torch.empty(num_tokens, n_out, dtype=torch.float32, device=x.device)
    ws = torch.empty(split_k, num_tokens, n_out, dtype=torch.float32, device=x.device) if split_k > 1 else y
    k_per_split = triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k
    _shrink_kernel[(num_tiles, num_col_blocks, split_k)](
        x, a, y, ws, locks, tiles, perm, ranks,
        K, r_max, n_out, k_per_split,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), y.stride(0), y.stride(1),
        num_tokens * n_out,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
        PRECISION=_precision(a.dtype), num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return y


def expand(
    x: torch.Tensor, b: torch.Tensor, out: torch.Tensor, tiles: torch.Tensor, perm: torch.Tensor,
    ranks: torch.Tensor, scalings: torch.Tensor, num_tiles: int, offsets: tuple[int, ...], *,
    block_m: int, block_n: int, block_k: int, num_warps: int = 4, num_stages: int = 2,
) -> None:  # fmt: skip
    """out[perm rows, slice j columns] += scaling * x[rows, slice j] @ b[slot, slice j]^T per tile.

    x: [T, num_slices * r_max]; b: [num_slots, N, r_max]; out: [T, N];
    offsets: num_slices + 1 (1 to 3 slices) host ints from 0 to N.
    """
    r_max = b.shape[2]
    bounds = list(offsets[1:]) + [offsets[-1]] * (4 - len(offsets))  # pad to (off1, off2, off3)
    num_blocks = sum(triton.cdiv(hi - lo, block_n) for lo, hi in zip(offsets, offsets[1:]))
    _expand_kernel[(num_tiles, num_blocks)](
        x, b, out, tiles, perm, ranks, scalings,
        r_max, bounds[0], bounds[1], bounds[2],
        x.stride(0), x.stride(1), b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=_precision(b.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
