"""The two grouped GEMMs over the expert-sorted layout of align.py.

One program computes a [BLOCK_M, BLOCK_N] tile of one BLOCK_M block of sorted pairs, all of one
expert: its rows are gathered by pair number, its weights are that expert's. Programs whose block
starts at or past num_post_padded exit at once, so the grid (every block the worst routing needs,
times the column tiles) depends on shapes only. Blocks are visited GROUP_M at a time per column
tile, so neighbouring programs reuse an expert's weight tile from L2.

- gate_up: h[p] = silu(x[p // k] @ w13[e, :I]^T) * (x[p // k] @ w13[e, I:]^T), both halves in one
  program (two accumulators), h [T * k, I] indexed by pair;
- down: out[p] = topk_weight[p] * (h[p] @ w2[e]^T), out [T * k, H] indexed by pair.

FP8 experts (`Scales`): the GEMM inputs (x, h) arrive quantized (FP8, with fp32 scales per row or
per row and 1 x bk group) and the weights are FP8 with per-channel ([E, N]) or block ([E, N / bn,
K / bk]) scales. The dots run on the FP8 values; per-channel scales are applied once at the end of
the K loop, block scales once per K step (BLOCK_K is then bk, so a step is one scale column).
NOTE: every FP8 K step's dot starts from zero and is added to the fp32 accumulator outside the dot.
Hopper's FP8 wgmma (64-row tiles) keeps a reduced-precision accumulator, so a running
`tl.dot(a, b, acc=acc)` over the whole K drifts: per-channel scales at 200 tokens (BLOCK_M 64) were
off by up to 0.04 on an H100. (max_num_imprecise_acc does the same inside the dot, but triton 3.6
refuses values under 32 for some tile shapes.) bf16/fp16/fp32 operands keep the running dot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class Launch:
    """One GEMM's tile sizes and launch settings (BLOCK_M comes from the layout)."""

    block_n: int = 64
    block_k: int = 64
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3


NO_SCALES, CHANNEL_SCALES, BLOCK_SCALES = 0, 1, 2


@dataclass(frozen=True)
class Scales:
    """The fp32 scales of one FP8 GEMM: `a` of its quantized input ([rows, 1] per row, or [rows,
    K / bk] per group) and `b` of its FP8 weight ([E, N] per channel, or [E, N / bn, K / bk])."""

    a: torch.Tensor
    b: torch.Tensor
    block: tuple[int, int] | None = None

    @property
    def mode(self) -> int:
        return CHANNEL_SCALES if self.block is None else BLOCK_SCALES

    def args(self) -> tuple:
        """(a, b, a's strides, b's strides) as the kernels take them (b's K stride 0 per channel)."""
        b_k = self.b.stride(2) if self.b.dim() == 3 else 0
        return self.a, self.b, self.a.stride(0), self.a.stride(1), self.b.stride(0), self.b.stride(1), b_k


def _scale_args(scales: Scales | None, fallback: torch.Tensor) -> tuple:
    return scales.args() if scales is not None else (fallback, fallback, 0, 0, 0, 0, 0)


@triton.jit
def _step_scales(sa_ptr, sb_ptr, a_rows, rows_ok, b_rows, n_ok, step, stride_sam, stride_sak, stride_sbn,
                 stride_sbk, GROUP_N: tl.constexpr):
    """(a's scales [BLOCK_M], b's scales [BLOCK_N]) of K step `step` (block scales) or of the whole
    row (per channel: step 0, stride_sak and stride_sbk unused), fp32."""
    sa = tl.load(sa_ptr + a_rows * stride_sam + step * stride_sak, mask=rows_ok, other=0.0)
    sb = tl.load(sb_ptr + (b_rows // GROUP_N) * stride_sbn + step * stride_sbk, mask=n_ok, other=0.0)
    return sa, sb


@triton.jit
def _tile(num_blocks, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(block, column tile) of this program: GROUP_M consecutive blocks per column tile."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first = (pid // per_group) * GROUP_M
    size = tl.minimum(num_blocks - first, GROUP_M)
    return first + (pid % per_group) % size, (pid % per_group) // size


@triton.jit
def _block_rows(sorted_ptr, expert_ids_ptr, block, num_pairs, BLOCK_M: tl.constexpr):
    """(pair numbers [BLOCK_M], row mask, expert as int64) of a block."""
    pairs = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    expert = tl.load(expert_ids_ptr + block).to(tl.int64)
    return pairs, pairs < num_pairs, expert


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, h_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
    sa_ptr, sb_ptr, stride_sam, stride_sak, stride_sbe, stride_sbn, stride_sbk,
    num_pairs, top_k, num_blocks, N, K,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_hm, stride_hn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, SCALES: tl.constexpr, GROUP_N: tl.constexpr,
):  # fmt: skip
    # x: [T, K]; w: [E, 2N, K] (gate rows, then up rows); h: [T * k, N]; N = I, K = H
    # FP8 (SCALES): x's scales sa [T, 1 or K / BLOCK_K]; w's sb [E, 2N, 1] or [E, 2N / GROUP_N, K / BLOCK_K]
    block, pid_n = _tile(num_blocks, N, BLOCK_N, GROUP_M)
    if block * BLOCK_M >= tl.load(num_post_ptr):
        return
    pairs, rows_ok, expert = _block_rows(sorted_ptr, expert_ids_ptr, block, num_pairs, BLOCK_M)
    tokens = (pairs // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * stride_xm + offs_k[None, :] * stride_xk
    g_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    u_ptrs = g_ptrs + N * stride_wn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=rows_ok[:, None], other=0.0)
            g = tl.load(g_ptrs, mask=n_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < K - k
            a = tl.load(a_ptrs, mask=rows_ok[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if SCALES == 2:  # block scales: this K step's
            sa, sg = _step_scales(sa_ptr, sb_ptr + expert * stride_sbe, tokens, rows_ok, offs_n, n_ok, k // BLOCK_K,
                                  stride_sam, stride_sak, stride_sbn, stride_sbk, GROUP_N)
            _, su = _step_scales(sa_ptr, sb_ptr + expert * stride_sbe, tokens, rows_ok, offs_n + N, n_ok,
                                 k // BLOCK_K, stride_sam, stride_sak, stride_sbn, stride_sbk, GROUP_N)
            gate += tl.dot(a, g) * sa[:, None] * sg[None, :]
            up += tl.dot(a, u) * sa[:, None] * su[None, :]
        elif SCALES == 1:  # per channel: a fresh dot per K step, summed in fp32 (the NOTE above)
            gate += tl.dot(a, g)
            up += tl.dot(a, u)
        else:
            gate = tl.dot(a, g, acc=gate, input_precision=PRECISION)
            up = tl.dot(a, u, acc=up, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_xk
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
    if SCALES == 1:  # per-channel weight and per-token input scales, once
        sa, sg = _step_scales(sa_ptr, sb_ptr + expert * stride_sbe, tokens, rows_ok, offs_n, n_ok, 0,
                              stride_sam, 0, stride_sbn, 0, 1)
        _, su = _step_scales(sa_ptr, sb_ptr + expert * stride_sbe, tokens, rows_ok, offs_n + N, n_ok, 0,
                             stride_sam, 0, stride_sbn, 0, 1)
        gate *= sa[:, None] * sg[None, :]
        up *= sa[:, None] * su[None, :]
    h = gate * tl.sigmoid(gate) * up
    h_ptrs = h_ptr + pairs[:, None].to(tl.int64) * stride_hm + offs_n[None, :] * stride_hn
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=rows_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, out_ptr, weights_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
    sa_ptr, sb_ptr, stride_sam, stride_sak, stride_sbe, stride_sbn, stride_sbk,
    num_pairs, num_blocks, N, K,
    stride_hm, stride_hk, stride_we, stride_wn, stride_wk, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, SCALES: tl.constexpr, GROUP_N: tl.constexpr,
):  # fmt: skip
    # h: [T * k, K]; w: [E, N, K]; weights: [T * k] float32; out: [T * k, N]; N = H, K = I
    # FP8 (SCALES): h's scales sa [T * k, 1 or K / BLOCK_K]; w's sb [E, N, 1] or [E, N / GROUP_N, K / BLOCK_K]
    block, pid_n = _tile(num_blocks, N, BLOCK_N, GROUP_M)
    if block * BLOCK_M >= tl.load(num_post_ptr):
        return
    pairs, rows_ok, expert = _block_rows(sorted_ptr, expert_ids_ptr, block, num_pairs, BLOCK_M)
    rows = pairs.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + rows[:, None] * stride_hm + offs_k[None, :] * stride_hk
    b_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=rows_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < K - k
            a = tl.load(a_ptrs, mask=rows_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if SCALES == 2:
            sa, sb = _step_scales(sa_ptr, sb_ptr + expert * stride_sbe, rows, rows_ok, offs_n, n_ok, k // BLOCK_K,
                                  stride_sam, stride_sak, stride_sbn, stride_sbk, GROUP_N)
            acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
        elif SCALES == 1:  # a fresh dot per K step, summed in fp32 (the NOTE above)
            acc += tl.dot(a, b)
        else:
            acc = tl.dot(a, b, acc=acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_hk
        b_ptrs += BLOCK_K * stride_wk
    if SCALES == 1:
        sa, sb = _step_scales(sa_ptr, sb_ptr + expert * stride_sbe, rows, rows_ok, offs_n, n_ok, 0,
                              stride_sam, 0, stride_sbn, 0, 1)
        acc *= sa[:, None] * sb[None, :]
    acc *= tl.load(weights_ptr + rows, mask=rows_ok, other=0.0)[:, None]
    out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=rows_ok[:, None] & n_ok[None, :])


def _scale_modes(scales: Scales | None, launch: Launch) -> dict:
    if scales is None:
        return dict(SCALES=NO_SCALES, GROUP_N=1)
    if scales.block is not None and scales.block[1] != launch.block_k:
        raise ValueError(f"moe_triton: block scales of {scales.block[1]} columns need block_k {scales.block[1]}, "
                         f"got {launch.block_k}")
    return dict(SCALES=scales.mode, GROUP_N=scales.block[0] if scales.block is not None else 1)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # ignored for 16-bit operands


def gate_up(x: torch.Tensor, w13: torch.Tensor, h: torch.Tensor, sorted_ids: torch.Tensor, expert_ids: torch.Tensor,
            num_post_padded: torch.Tensor, top_k: int, num_blocks: int, block_m: int, launch: Launch,
            scales: Scales | None = None) -> None:
    """h[:T * k] = silu(gate) * up of every pair. x: [T, H]; w13: [E, 2I, H]; h: [>= T * k, I], x's dtype
    (FP8 with `scales`: x and w13 FP8, h in the model dtype; launch.block_k must be the block's bk)."""
    num_pairs, n, k = x.shape[0] * top_k, w13.shape[1] // 2, x.shape[1]
    grid = (num_blocks * triton.cdiv(n, launch.block_n),)
    _gate_up_kernel[grid](
        x, w13, h, sorted_ids, expert_ids, num_post_padded, *_scale_args(scales, x),
        num_pairs, top_k, num_blocks, n, k,
        x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2), h.stride(0), h.stride(1),
        BLOCK_M=block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, GROUP_M=launch.group_m,
        EVEN_K=k % launch.block_k == 0, PRECISION=_precision(x.dtype), **_scale_modes(scales, launch),
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )  # fmt: skip


def down(h: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, sorted_ids: torch.Tensor,
         expert_ids: torch.Tensor, num_post_padded: torch.Tensor, num_pairs: int, num_blocks: int, block_m: int,
         launch: Launch, scales: Scales | None = None) -> None:
    """out[:num_pairs] = weight * (h @ w2[e]^T) of every pair. h: [>= num_pairs, I]; w2: [E, H, I];
    weights: [num_pairs] float32; out: [>= num_pairs, H], h's dtype (FP8 with `scales`: h and w2 FP8,
    out in the model dtype; launch.block_k must be the block's bk)."""
    n, k = w2.shape[1], w2.shape[2]
    grid = (num_blocks * triton.cdiv(n, launch.block_n),)
    _down_kernel[grid](
        h, w2, out, weights, sorted_ids, expert_ids, num_post_padded, *_scale_args(scales, h),
        num_pairs, num_blocks, n, k,
        h.stride(0), h.stride(1), w2.stride(0), w2.stride(1), w2.stride(2), out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, GROUP_M=launch.group_m,
        EVEN_K=k % launch.block_k == 0, PRECISION=_precision(h.dtype), **_scale_modes(scales, launch),
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )  # fmt: skip
