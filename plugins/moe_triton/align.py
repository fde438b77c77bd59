"""Sort the (token, slot) pairs by expert, each expert's run padded to a multiple of BLOCK_M.

The T * k pairs are numbered p = t * k + j (topk_ids flattened). The layout the GEMM kernels read:
- sorted_ids [num_blocks * BLOCK_M] int32: pair numbers grouped by expert, in pair order within an
  expert; each expert's run starts at a multiple of BLOCK_M and its padding holds the sentinel
  T * k (the number of pairs), which every kernel masks out;
- expert_ids [num_blocks] int32: the expert of each BLOCK_M block, -1 past the last used block;
- num_post_padded [1] int32: the rows used, a multiple of BLOCK_M.

Every size depends on T, k, E and BLOCK_M only, never on the routing: num_blocks covers the worst
case (T * k pairs plus BLOCK_M - 1 padding rows for each expert that can be non-empty), so the
layout is computed on the device without a host sync and replays inside CUDA graphs. Entries of
sorted_ids past num_post_padded are left as they were: no kernel reads them.

Up to SINGLE_PROGRAM_PAIRS pairs one program does everything (one launch: decode sizes). More pairs
take three launches over CHUNK-pair chunks: per-chunk expert counts (stored expert-major), one
program turning them into the layout and each chunk's first destination per expert (a scan along
the chunks, a tile of them at a time), then the scatter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SINGLE_PROGRAM_PAIRS = 1024
MAX_EXPERTS = 1024
ONEHOT_ELEMENTS = 1 << 15  # a chunk's [E_PAD, CHUNK] one-hot tile


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The rows of the worst routing: every pair, plus BLOCK_M - 1 rows of padding for each expert
    that can be non-empty (at most min(pairs, E) of them), rounded up to whole blocks."""
    rows = num_pairs + min(num_pairs, num_experts) * (block_m - 1)
    return triton.cdiv(rows, block_m) * block_m


def chunk_size(num_experts: int) -> int:
    return max(16, min(256, ONEHOT_ELEMENTS // triton.next_power_of_2(num_experts)))


def num_chunks(num_pairs: int, num_experts: int) -> int:
    return triton.cdiv(num_pairs, chunk_size(num_experts))


@triton.jit
def _chunk_onehot(ids_ptr, start, num_pairs, num_experts, CHUNK: tl.constexpr, E_PAD: tl.constexpr):
    """(pair numbers [CHUNK], valid [CHUNK], one-hot [E_PAD, CHUNK] int32) of the chunk at `start`.
    Experts along axis 0: the scans and sums along the pairs run over the fastest axis."""
    pairs = start + tl.arange(0, CHUNK)
    experts = tl.arange(0, E_PAD)
    ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
    valid = (pairs < num_pairs) & (ids >= 0) & (ids < num_experts)
    onehot = ((experts[:, None] == ids[None, :]) & valid[None, :]).to(tl.int32)
    return pairs, valid, onehot


@triton.jit
def _scatter_chunk(ids_ptr, sorted_ptr, start, cursor, num_pairs, num_experts,
                   CHUNK: tl.constexpr, E_PAD: tl.constexpr):
    """Store the chunk's pairs at cursor[expert] + their rank among the chunk's pairs of that expert;
    returns the chunk's count per expert."""
    pairs, valid, onehot = _chunk_onehot(ids_ptr, start, num_pairs, num_experts, CHUNK, E_PAD)
    rank = tl.cumsum(onehot, axis=1) - onehot  # [E_PAD, CHUNK]: earlier pairs of the same expert
    dest = tl.sum(onehot * (rank + cursor[:, None]), axis=0)
    tl.store(sorted_ptr + dest, pairs, mask=valid)
    return tl.sum(onehot, axis=1)


@triton.jit
def _write_layout(counts, sorted_ptr, expert_ids_ptr, num_post_ptr, num_blocks, num_experts, sentinel,
                  BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, BLOCKS_CHUNK: tl.constexpr):
    """From the per-expert counts [E_PAD]: num_post_padded, every block's expert, the sentinel in
    each expert's padding rows. Returns each expert's first row [E_PAD]."""
    experts = tl.arange(0, E_PAD)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    tl.store(num_post_ptr, total)
    # padding rows: starts + counts .. ends of each expert (fewer than BLOCK_M)
    fill = (starts + counts)[:, None] + tl.arange(0, BLOCK_M)[None, :]
    tl.store(sorted_ptr + fill, sentinel + tl.zeros([E_PAD, BLOCK_M], dtype=tl.int32), mask=fill < ends[:, None])
    # a block's expert: the number of experts whose run ends at or before the block's first row
    real = experts < num_experts
    for b0 in range(0, num_blocks, BLOCKS_CHUNK):
        blocks = b0 + tl.arange(0, BLOCKS_CHUNK)
        first = blocks * BLOCK_M
        before = (ends[None, :] <= first[:, None]) & real[None, :]
        expert = tl.where(first < total, tl.sum(before.to(tl.int32), axis=1), -1)
        tl.store(expert_ids_ptr + blocks, expert, mask=blocks < num_blocks)
    return starts


@triton.jit
def _align_single_kernel(ids_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr, num_pairs, num_experts, num_blocks,
                         BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
                         BLOCKS_CHUNK: tl.constexpr):
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        _, _, onehot = _chunk_onehot(ids_ptr, start, num_pairs, num_experts, CHUNK, E_PAD)
        counts += tl.sum(onehot, axis=1)
    cursor = _write_layout(counts, sorted_ptr, expert_ids_ptr, num_post_ptr, num_blocks, num_experts, num_pairs,
                           BLOCK_M, E_PAD, BLOCKS_CHUNK)
    for start in range(0, num_pairs, CHUNK):
        cursor += _scatter_chunk(ids_ptr, sorted_ptr, start, cursor, num_pairs, num_experts, CHUNK, E_PAD)


@triton.jit
def _align_count_kernel(ids_ptr, chunk_counts_ptr, num_pairs, num_experts, n_chunks,
                        CHUNK: tl.constexpr, E_PAD: tl.constexpr):
    # chunk_counts: [E_PAD, n_chunks] int32 (expert-major: the prefix kernel scans along the chunks)
    chunk = tl.program_id(0)
    _, _, onehot = _chunk_onehot(ids_ptr, chunk * CHUNK, num_pairs, num_experts, CHUNK, E_PAD)
    tl.store(chunk_counts_ptr + tl.arange(0, E_PAD) * n_chunks + chunk, tl.sum(onehot, axis=1))


@triton.jit
def _align_prefix_kernel(chunk_counts_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr, num_pairs, num_experts,
                         num_blocks, n_chunks, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr,
                         CHUNKS_TILE: tl.constexpr, BLOCKS_CHUNK: tl.constexpr):
    # overwrites chunk_counts[e, c] with chunk c's first destination row for expert e
    rows = tl.arange(0, E_PAD)[:, None] * n_chunks
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for c0 in range(0, n_chunks, CHUNKS_TILE):
        chunks = c0 + tl.arange(0, CHUNKS_TILE)[None, :]
        counts += tl.sum(tl.load(chunk_counts_ptr + rows + chunks, mask=chunks < n_chunks, other=0), axis=1)
    cursor = _write_layout(counts, sorted_ptr, expert_ids_ptr, num_post_ptr, num_blocks, num_experts, num_pairs,
                           BLOCK_M, E_PAD, BLOCKS_CHUNK)
    for c0 in range(0, n_chunks, CHUNKS_TILE):
        chunks = c0 + tl.arange(0, CHUNKS_TILE)[None, :]
        tile = tl.load(chunk_counts_ptr + rows + chunks, mask=chunks < n_chunks, other=0)  # [E_PAD, CHUNKS_TILE]
        tl.store(chunk_counts_ptr + rows + chunks, cursor[:, None] + tl.cumsum(tile, axis=1) - tile,
                 mask=chunks < n_chunks)
        cursor += tl.sum(tile, axis=1)


@triton.jit
def _align_scatter_kernel(ids_ptr, chunk_counts_ptr, sorted_ptr, num_pairs, num_experts, n_chunks,
                          CHUNK: tl.constexpr, E_PAD: tl.constexpr):
    chunk = tl.program_id(0)
    cursor = tl.load(chunk_counts_ptr + tl.arange(0, E_PAD) * n_chunks + chunk)
    _scatter_chunk(ids_ptr, sorted_ptr, chunk * CHUNK, cursor, num_pairs, num_experts, CHUNK, E_PAD)


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int, sorted_ids: torch.Tensor,
          expert_ids: torch.Tensor, num_post_padded: torch.Tensor, chunk_counts: torch.Tensor) -> int:
    """Fill the layout (module docstring) for topk_ids [T, k] into the given buffers; returns the
    number of blocks the GEMM grids cover (max_padded_rows / block_m).

    sorted_ids: int32, at least max_padded_rows(T * k, E, block_m) entries; expert_ids: int32, at
    least that / block_m; num_post_padded: int32 [1]; chunk_counts: int32, at least
    num_chunks(T * k, E) * next_power_of_2(E) entries (used above SINGLE_PROGRAM_PAIRS pairs).
    """
    num_pairs = topk_ids.numel()
    if not 0 < num_experts <= MAX_EXPERTS:
        raise ValueError(f"moe_triton: num_experts {num_experts} is out of range; expected 1 to {MAX_EXPERTS}")
    ids = topk_ids.reshape(-1)
    num_blocks = max_padded_rows(num_pairs, num_experts, block_m) // block_m
    e_pad = triton.next_power_of_2(num_experts)
    blocks_chunk = _pow2_tile(num_blocks, ONEHOT_ELEMENTS // e_pad)
    if num_pairs <= SINGLE_PROGRAM_PAIRS:
        chunk = _pow2_tile(num_pairs, chunk_size(num_experts))  # NOTE: decode sizes: a small tile, a quick program
        _align_single_kernel[(1,)](ids, sorted_ids, expert_ids, num_post_padded, num_pairs, num_experts, num_blocks,
                                   BLOCK_M=block_m, E_PAD=e_pad, CHUNK=chunk, BLOCKS_CHUNK=blocks_chunk,
                                   num_warps=_warps(chunk * e_pad))
        return num_blocks
    chunk = chunk_size(num_experts)
    n_chunks = triton.cdiv(num_pairs, chunk)
    chunks_tile = _pow2_tile(n_chunks, ONEHOT_ELEMENTS // 4 // e_pad)
    _align_count_kernel[(n_chunks,)](ids, chunk_counts, num_pairs, num_experts, n_chunks, CHUNK=chunk, E_PAD=e_pad,
                                     num_warps=_warps(chunk * e_pad))
    _align_prefix_kernel[(1,)](chunk_counts, sorted_ids, expert_ids, num_post_padded, num_pairs, num_experts,
                               num_blocks, n_chunks, BLOCK_M=block_m, E_PAD=e_pad, CHUNKS_TILE=chunks_tile,
                               BLOCKS_CHUNK=blocks_chunk, num_warps=8)
    _align_scatter_kernel[(n_chunks,)](ids, chunk_counts, sorted_ids, num_pairs, num_experts, n_chunks, CHUNK=chunk,
                                       E_PAD=e_pad, num_warps=_warps(chunk * e_pad))
    return num_blocks


def _pow2_tile(count: int, most: int) -> int:
    """A power-of-two tile covering `count` items, 16 to max(16, most)."""
    return max(16, min(triton.next_power_of_2(count), most))


def _warps(elements: int) -> int:
    return 4 if elements <= 8192 else 8
