"""The decode LoRA kernel: shrink and expand of one projection group in a single launch.

One program per (adapter slot, column span, K split). It finds its slot's tokens in the batch's
per-token slot vector (`LoraBatchInfo.token_slots`, a persistent device buffer) and computes their
rank-R shrink over its share of K for the slice its columns belong to, x[tokens] @ A_j[slot]^T, in
registers. With one split it then adds scaling * y @ B[slot, span]^T into the base output; with
several, each stores its partial y and the last split of the span to arrive (an atomic counter,
re-armed after use) sums them and expands. No host plan, no tensor between the two halves, one
launch per projection group; the grid depends only on the weight shapes (graph-safe).

Every span of a slot recomputes the slice's shrink (A is re-read, from L2), and every program works
on all BLOCK_T token rows (masked), so this layout is for decode-sized batches: `FUSED_MAX_TOKENS`
tokens at most. Larger batches use the segmented kernels of kernels.py, which read each weight once
per tile of up to 64 tokens of one adapter. `choose_split` balances a program's share of A against
its span of B.

Registered as the torch custom op `backplane_lora_triton::fused_shrink_expand` (in place into
`out`) for torch.compile; eager callers and graph captures launch the kernel directly.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

FUSED_MAX_TOKENS = 64  # BLOCK_T rows per program; beyond this the segmented kernels win


@triton.jit
def _fused_kernel(
    x_ptr, a_ptr, b_ptr, out_ptr, token_slots_ptr, ranks_ptr, scalings_ptr, ws_ptr, locks_ptr,
    num_tokens, K, r_max, off1, off2, off3, k_per_split, span,
    stride_xm, stride_xk, stride_as, stride_an, stride_ak, stride_bs, stride_bn, stride_bk,
    stride_om, stride_on,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr, GROUPS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # x: [T, K]; a: [num_slots, num_slices * r_max, K]; b: [num_slots, off3, r_max]; out: [T, off3].
    # Slice j owns columns [off_j, off_j+1) (off0 = 0) and the cdiv(width_j, span) consecutive
    # spans along axis 1 that cover them. Axis 2 splits the shrink's K: each split stores its
    # partial y in ws [num_slots, GROUPS (>= spans * SPLIT_K), BLOCK_T, BLOCK_R] float32 at
    # (slot, span * SPLIT_K + split); the last split of a (slot, span) to arrive (locks
    # [num_slots, GROUPS] int32, zero between launches) sums them in split order (deterministic),
    # expands and re-arms the lock.
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rank = tl.load(ranks_ptr + slot)
    if rank == 0:  # the base-only slot, or a free one: the whole (slot, span) group exits
        return
    offs_t = tl.arange(0, BLOCK_T)
    token_slot = tl.load(token_slots_ptr + offs_t, mask=offs_t < num_tokens, other=-1)
    t_mask = token_slot == slot
    if tl.max(t_mask.to(tl.int32), axis=0) == 0:  # no token of the batch uses this slot
        return
    first1 = tl.cdiv(off1, span)
    first2 = first1 + tl.cdiv(off2 - off1, span)
    j = (pid_n >= first1).to(tl.int32) + (pid_n >= first2).to(tl.int32)
    first = tl.where(j == 0, 0, tl.where(j == 1, first1, first2))
    col_begin = tl.where(j == 0, 0, tl.where(j == 1, off1, off2))
    col_end = tl.where(j == 0, off1, tl.where(j == 1, off2, off3))
    span_begin = col_begin + (pid_n - first) * span
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    rows = offs_t.to(tl.int64)
    k_begin = pid_k * k_per_split
    y = _shrink_rows(x_ptr + rows[:, None] * stride_xm, t_mask,
                     a_ptr + slot.to(tl.int64) * stride_as + (j * r_max + offs_r)[None, :] * stride_an,
                     r_mask, k_begin, tl.minimum(K, k_begin + k_per_split), stride_xk, stride_ak,
                     BLOCK_T, BLOCK_R, BLOCK_K, PRECISION)
    b_rows = b_ptr + slot.to(tl.int64) * stride_bs + offs_r[:, None] * stride_bk
    out_rows = out_ptr + rows[:, None] * stride_om
    scaling = tl.load(scalings_ptr + slot)
    span_end = tl.minimum(col_end, span_begin + span)
    if SPLIT_K == 1:
        _expand_span(y, b_rows, r_mask, out_rows, t_mask, scaling, span_begin, span_end, stride_bn, stride_on,
                     BLOCK_N, PRECISION)
    else:
        lock = locks_ptr + slot * GROUPS + pid_n
        tile = offs_t[:, None] * BLOCK_R + offs_r[None, :]
        ws_span = ws_ptr + (slot * GROUPS + pid_n * SPLIT_K).to(tl.int64) * (BLOCK_T * BLOCK_R)
        tl.store(ws_span + pid_k * (BLOCK_T * BLOCK_R) + tile, y)
        tl.debug_barrier()  # NOTE: all threads' stores happen before the release below
        if tl.atomic_add(lock, 1, sem="acq_rel") == SPLIT_K - 1:
            total = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
            for split in tl.static_range(SPLIT_K):
                total += tl.load(ws_span + split * (BLOCK_T * BLOCK_R) + tile, cache_modifier=".cg")
            _expand_span(total, b_rows, r_mask, out_rows, t_mask, scaling, span_begin, span_end, stride_bn,
                         stride_on, BLOCK_N, PRECISION)
            tl.atomic_xchg(lock, 0)


@triton.jit
def _shrink_rows(x_rows, t_mask, a_cols, r_mask, k_begin, k_end, stride_xk, stride_ak,
                 BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """y [BLOCK_T, BLOCK_R] float32 = x[rows, k_begin:k_end] @ A[:, k_begin:k_end]^T; masked rows and
    ranks read nothing."""
    offs_k = tl.arange(0, BLOCK_K)
    y = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for k in range(k_begin, k_end, BLOCK_K):
        kk = k + offs_k
        k_mask = kk < k_end
        x = tl.load(x_rows + kk[None, :] * stride_xk, mask=t_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_cols + kk[:, None] * stride_ak, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        y += tl.dot(x.to(a.dtype), a, input_precision=PRECISION)
    return y


@triton.jit
def _expand_span(y, b_rows, r_mask, out_rows, t_mask, scaling, col_begin, col_end, stride_bn, stride_on,
                 BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """out[rows, col_begin:col_end] += scaling * y @ B[:, cols], BLOCK_N columns at a time."""
    for n in range(col_begin, col_end, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < col_end
        b = tl.load(b_rows + offs_n[None, :] * stride_bn, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        delta = tl.dot(y.to(b.dtype), b, input_precision=PRECISION)  # [BLOCK_T, BLOCK_N]
        out_ptrs = out_rows + offs_n[None, :] * stride_on
        mask = t_mask[:, None] & n_mask[None, :]
        base = tl.load(out_ptrs, mask=mask, other=0.0)
        tl.store(out_ptrs, (base.to(tl.float32) + delta * scaling).to(base.dtype), mask=mask)


def _pow2_between(value: int, low: int, high: int) -> int:
    return max(low, min(high, triton.next_power_of_2(value)))


def tile_sizes(num_tokens: int, r_max: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_R) of a launch: the padded token rows and rank (what a tuned entry is keyed by)."""
    return _pow2_between(num_tokens, 16, FUSED_MAX_TOKENS), _pow2_between(r_max, 16, 128)


MAX_GROUPS = 256  # (span, split) programs per slot and launch: sizes the workspace and the locks
MIN_SPAN = 128
MIN_SPLIT_K = 256  # the least of K one split reads
PROGRAMS_IN_FLIGHT = 256  # programs whose loads the device overlaps (about two per SM of an H100/H200)


@functools.lru_cache(maxsize=256)
def choose_split(k: int, widths: tuple[int, ...], block_r: int, element_size: int, num_adapters: int) -> tuple[int, int]:
    """(span, split_k) for a launch, from a model of its reads (bytes, A and B at block_r):

    - one program reads its share of A (block_r x K / split_k) and, for the last split of a span,
      the span's B (span x block_r): that bounds its latency;
    - every span re-reads its slice's A, so the launch reads num_adapters x (spans x A_j + B) in
      all, which PROGRAMS_IN_FLIGHT programs share.
    The launch takes about the larger of the two; ties go to fewer programs.
    """
    best = None
    a_slice = block_r * k * element_size
    b_all = sum(widths) * block_r * element_size
    for split_k in (1, 2, 4, 8, 16):
        if split_k > 1 and k // split_k < MIN_SPLIT_K:
            break
        for span in (128, 256, 512, 1024, 2048, 4096, 8192):
            spans = sum(triton.cdiv(w, span) for w in widths)
            if spans * split_k > MAX_GROUPS:
                continue
            one = a_slice // split_k + span * block_r * element_size
            total = max(num_adapters, 1) * (spans * a_slice + b_all)
            cost = (max(one, total // PROGRAMS_IN_FLIGHT), spans * split_k)
            if best is None or cost < best[0]:
                best = (cost, span, split_k)
    if best is None:
        return 8192, 1  # widths beyond 8192 * MAX_GROUPS columns: one program per big span
    return best[1], best[2]


@dataclass(frozen=True)
class FusedConfig:
    """Launch settings of the fused kernel (0: automatic)."""

    span: int = 0
    split_k: int = 0
    num_warps: int = 0
    num_stages: int = 2  # a split reads one or two K tiles: deeper pipelines only cost shared memory


@dataclass
class FusedBuffers:
    """The split-K workspace and locks of one backend: allocated once (graph-safe), locks always
    zero between launches. Launches that share them must not run concurrently (one stream).

    ws: [num_slots * MAX_GROUPS * FUSED_MAX_TOKENS * block_r] float32; locks: [num_slots * MAX_GROUPS] int32.
    """

    ws: torch.Tensor
    locks: torch.Tensor

    @classmethod
    def allocate(cls, device: torch.device, num_slots: int, r_max: int) -> FusedBuffers:
        block_r = _pow2_between(r_max, 16, 128)
        size = num_slots * MAX_GROUPS * FUSED_MAX_TOKENS * block_r  # enough for any split layout
        return cls(torch.empty(size, dtype=torch.float32, device=device),
                   torch.zeros(num_slots * MAX_GROUPS, dtype=torch.int32, device=device))

    def fits(self, num_slots: int, r_max: int) -> bool:
        block_r = _pow2_between(r_max, 16, 128)
        return (self.locks.numel() >= num_slots * MAX_GROUPS
                and self.ws.numel() >= num_slots * MAX_GROUPS * FUSED_MAX_TOKENS * block_r)


def launch(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, token_slots: torch.Tensor,
    ranks: torch.Tensor, scalings: torch.Tensor, offsets: list[int], buffers: FusedBuffers,
    config: FusedConfig = FusedConfig(),
) -> None:  # fmt: skip
    """out[t, slice j] += scaling[slot(t)] * (x[t] A_j[slot(t)]^T) B_j[slot(t)]^T for t < T, in place.

    x: [T, K] with T <= FUSED_MAX_TOKENS; a: [num_slots, num_slices * r_max, K]; b: [num_slots, N,
    r_max]; out: [T, N]; token_slots: int32, the slot of each token (rows beyond its length are not
    covered); ranks [num_slots] int32; scalings [num_slots] float32; offsets: num_slices + 1 (1 to 3)
    host ints from 0 to N; buffers: made for at least num_slots slots and r_max.
    """
    (num_tokens, k), (num_slots, _, r_max) = x.shape, b.shape
    if num_tokens > FUSED_MAX_TOKENS:
        raise ValueError(f"fused LoRA kernel: expected at most {FUSED_MAX_TOKENS} tokens, got {num_tokens}")
    if num_tokens == 0:
        return
    widths = tuple(hi - lo for lo, hi in zip(offsets, offsets[1:]))
    block_t, block_r = tile_sizes(num_tokens, r_max)
    span, split_k = choose_split(k, widths, block_r, a.element_size(), num_slots - 1)
    span, split_k = max(config.span or span, MIN_SPAN), config.split_k or split_k
    groups = sum(triton.cdiv(w, span) for w in widths)
    if split_k > 1 and (groups * split_k > MAX_GROUPS or not buffers.fits(num_slots, r_max)):
        raise ValueError(f"fused LoRA kernel: span {span} x split_k {split_k} needs more than the "
                         f"{MAX_GROUPS} programs per slot (or the buffers are too small)")
    # A tiles of 8-16 KB per stage keep the shrink's loads in flight; a split's K is whole tiles
    block_k = min(256 if block_r <= 32 else 128 if block_r <= 64 else 64,
                  _pow2_between(triton.cdiv(k, split_k), 16, 256))
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    num_warps = config.num_warps or (8 if block_t * block_k >= 64 * 128 else 4)
    bounds = list(offsets[1:]) + [offsets[-1]] * (4 - len(offsets))  # pad to (off1, off2, off3)
    precision = "ieee" if a.dtype == torch.float32 else "tf32"  # ignored for 16-bit operands
    _fused_kernel[(num_slots, groups, split_k)](
        x, a, b, out, token_slots, ranks, scalings, buffers.ws, buffers.locks,
        min(num_tokens, token_slots.numel()), k, r_max, bounds[0], bounds[1], bounds[2], k_per_split, span,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2),
        b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1),
        BLOCK_T=block_t, BLOCK_R=block_r, BLOCK_K=block_k, BLOCK_N=64 if block_r > 32 else 128,
        SPLIT_K=split_k, GROUPS=MAX_GROUPS, PRECISION=precision, num_warps=num_warps,
        num_stages=config.num_stages,
    )  # fmt: skip


@torch.library.custom_op("backplane_lora_triton::fused_shrink_expand", mutates_args=("out", "ws", "locks"))
def fused_shrink_expand_op(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, token_slots: torch.Tensor,
    ranks: torch.Tensor, scalings: torch.Tensor, ws: torch.Tensor, locks: torch.Tensor, offsets: list[int],
    config: list[int],
) -> None:  # fmt: skip
    """ws, locks: a FusedBuffers' tensors; config: the FusedConfig fields in order."""
    launch(x, a, b, out, token_slots, ranks, scalings, offsets, FusedBuffers(ws, locks), FusedConfig(*config))


@fused_shrink_expand_op.register_fake
def _fused_shrink_expand_fake(x, a, b, out, token_slots, ranks, scalings, ws, locks, offsets, config) -> None:
    return None  # in place into `out`: no new tensor


def fused_shrink_expand(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, token_slots: torch.Tensor,
    ranks: torch.Tensor, scalings: torch.Tensor, offsets: list[int], buffers: FusedBuffers,
    config: FusedConfig = FusedConfig(),
) -> torch.Tensor:  # fmt: skip
    """`launch`, through the custom op while torch.compile traces, directly otherwise; returns out."""
    if torch.compiler.is_compiling():
        fields = [config.span, config.split_k, config.num_warps, config.num_stages]
        torch.ops.backplane_lora_triton.fused_shrink_expand(
            x, a, b, out, token_slots, ranks, scalings, buffers.ws, buffers.locks, list(offsets), fields
        )
    else:
        launch(x, a, b, out, token_slots, ranks, scalings, list(offsets), buffers, config)
    return out
