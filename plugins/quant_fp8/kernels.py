"""Triton kernels of quant_fp8: dynamic activation quantization and two FP8 GEMMs sized for decode.

  quantize_rows   x [M, K] -> q [M, K] fp8 and one scale per row [M, 1] (per token) or per run of
                  `group` columns [M, K / group] (block-wise FP8's 1 x bk groups), computed as
                  quantize.py computes them on CUDA (below)
  channel_matmul  y = (xq @ wq^T) * sx[m] * sw[n] (+ bias): per-channel (or per-tensor) weight
                  scales and per-token (or per-tensor) activation scales, applied in the epilogue
  block_matmul    y = sum over K blocks kb of (xq @ wq^T)_kb * sx[m, kb] * sw[n // bn, kb] (+ bias):
                  128 x 128 weight blocks, both scales applied once per K step

Per-token scales take an optional upper bound on each row's max |x| (`scale_ub`, fbgemm_fp8's
activation_scale_ub, a compile-time constant: 0 for none): scale = min(amax, ub) / 448, wherever a
row is quantized (quantize_rows, or inside channel_matmul).

At decode sizes (M up to ~64) a GEMM only streams its FP8 weight: one program per BLOCK_N output
columns and (split-K) per slice of K, so that enough programs read the weight at once to fill the
card. With split_k > 1 every program stores its fp32 partial tile in a workspace and bumps its
tile's counter; the last to arrive sums the partials in slice order (the result does not depend on
which program came last), adds the bias, writes the output and sets the counter back to zero.
`fuse_quant` quantizes x inside the GEMM (one launch): channel_matmul first reads x's rows once for
their maxima (cheap while M * K is small); block_matmul quantizes each 1 x BLOCK_K group as it
loads it; at M = 1 both quantize the one row and broadcast it to the tile's 16 rows (tl.dot needs
16). Otherwise quantize_rows runs first. Nothing depends on the data on the host: CUDA graphs
capture every path.

A launch with `gemv` (M up to GEMV_MAX_ROWS) runs either GEMM's GEMV kernel instead: the same
operands, scales, split K and epilogue, without tl.dot (no padding of M to 16 rows; the weight tile
read as stored, [BLOCK_N, BLOCK_K] with K contiguous). Its results differ from the tl.dot kernels'
only in the order of fp32 sums.

Scales are computed as torch computes quantize.py's `amax / FP8_MAX` on CUDA: amax times the fp32
reciprocal of 448 (a scalar divisor is a multiplication there; on CPU it is a true division, which
can differ in the last bit). x / scale is a true division (tl.math.div_rn), as torch's.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from backplane.plugins.quant_fp8 import quantize as fq


FP8_MAX = tl.constexpr(fq.FP8_MAX)
FP8_MAX_RECIPROCAL = tl.constexpr(float(torch.tensor(1.0 / fq.FP8_MAX, dtype=torch.float32)))
MIN_SCALE = tl.constexpr(fq.MIN_SCALE)
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
MIN_BLOCK_N = 16  # the narrowest output tile; new_counters holds one counter per MIN_BLOCK_N columns
QUANT_GROUP = 128  # quantize_rows holds a row as [cdiv(K, QUANT_GROUP), QUANT_GROUP] in per-token mode
MAX_ROW = 1 << 16  # quantize_rows holds a whole row in registers: K up to this
AMAX_ELEMENTS = 4096  # the fused quantization's pre-pass loads x in tiles of about this many elements
GEMV_MAX_ROWS = 8  # the GEMV kernels loop over x's rows one at a time (unrolled): M up to this


@dataclass(frozen=True)
class Launch:
    """One GEMM launch: output tile width, K step, K slices, warps, pipeline depth, whether x is
    quantized inside the GEMM, and whether it runs the GEMV kernel (no tl.dot; M up to
    GEMV_MAX_ROWS). BLOCK_M follows M (block_m_for); block_matmul's K step is the weight block's
    columns, so its block_k is ignored."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    fuse_quant: bool = False
    gemv: bool = False

    def __post_init__(self):
        pow2 = all(v > 0 and v & (v - 1) == 0 for v in (self.block_n, self.block_k, self.num_warps))
        if not pow2 or self.block_n < MIN_BLOCK_N or self.block_k < 16 or self.split_k < 1 or self.num_stages < 1:
            raise ValueError(f"{self}: expected block_n >= {MIN_BLOCK_N} and block_k >= 16 powers of two, "
                             "num_warps a power of two, split_k and num_stages >= 1")


def block_m_for(m: int) -> int:
    """The GEMMs' tile height for M rows: M padded to a power of two, 16 to 64."""
    return min(64, max(16, triton.next_power_of_2(m)))


# -- shared pieces -------------------------------------------------------------------------------

@triton.jit
def _scale_of(amax):
    """max |x| (fp32) -> the dynamic scale max(amax / 448, 1e-12), as torch computes it on CUDA."""
    return tl.maximum(amax * FP8_MAX_RECIPROCAL, MIN_SCALE)


@triton.jit
def _row_scale_of(amax, SCALE_UB: tl.constexpr):
    """A row's dynamic scale with the per-token upper bound: _scale_of(min(amax, SCALE_UB)); SCALE_UB
    0 is no bound (then exactly _scale_of(amax))."""
    if SCALE_UB > 0:
        amax = tl.minimum(amax, SCALE_UB)
    return _scale_of(amax)


@triton.jit
def _to_fp8(x, scale):
    """fp32 x / scale, clamped to +-448, rounded to e4m3 (nearest, ties to even)."""
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
    if INTERPRETED:
        q = _round_to_e4m3(q)
    return q.to(tl.float8e4nv)


@triton.jit
def _round_to_e4m3(q):
    """fp32 q (|q| <= 448) -> the nearest e4m3 value (ties to even), still fp32. NOTE: Triton's
    interpreter (3.9) casts fp32 to e4m3 without the carry into the exponent (127.7 -> 64), so under
    it the kernels round first and the cast is exact; compiled kernels use the hardware's cast."""
    bits = q.to(tl.int32, bitcast=True)
    exp = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # below e4m3's smallest normal, 2^-6: steps of 2^-9
    magic = (((exp + 147) << 23) | 0x400000).to(tl.float32, bitcast=True)  # 1.5 * 2^23 steps of 2^(exp - 3)
    r = (tl.abs(q) + magic) - magic  # the fp32 add rounds to a multiple of the step, ties to even
    return tl.where(bits < 0, -r, r)


@triton.jit
def _wait_for_inputs(GDC: tl.constexpr):
    """Under programmatic dependent launch (GDC): wait here until the previous kernel of the stream has
    finished and its writes are visible, then let the next kernel launch. Everything a GEMM reads
    before this is its weight (or the weight's scales), which no kernel of a forward writes."""
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _store_result(acc, bias_ptr, y_ptr, ws_ptr, counters_ptr, rm, rn, M, N, stride_ym, pid_k, split_k, tile,
                  HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Write acc [BLOCK_M, BLOCK_N] (scaled, fp32) to y with the bias. With split_k > 1 acc is one K
    slice's share: the last program of the tile to arrive sums every share in slice order, writes y
    and resets the tile's counter."""
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if split_k == 1:
        _write_tile(acc, bias_ptr, y_ptr, rm, rn, N, mask, stride_ym, HAS_BIAS)
    else:
        shares = ws_ptr + rm[:, None] * N + rn[None, :]  # ws [split_k, M, N] fp32
        tl.store(shares + pid_k * M * N, acc, mask=mask)
        tl.debug_barrier()  # NOTE: every thread's share is stored before the counter says so
        arrived = tl.atomic_add(counters_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == split_k - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(0, split_k):
                total += tl.load(shares + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(counters_ptr + tile, 0)  # ready for the next call
            _write_tile(total, bias_ptr, y_ptr, rm, rn, N, mask, stride_ym, HAS_BIAS)


@triton.jit
def _write_tile(acc, bias_ptr, y_ptr, rm, rn, N, mask, stride_ym, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


# -- activation quantization ---------------------------------------------------------------------

@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_sm, GROUP: tl.constexpr,
                     NUM_GROUPS: tl.constexpr, PER_ROW: tl.constexpr, SCALE_UB: tl.constexpr):
    """One row per program, held as a [NUM_GROUPS, GROUP] tile: q = x / scale in fp8, and one scale
    for the row (PER_ROW; its max |x| bounded by SCALE_UB unless 0) or one per GROUP columns."""
    m = tl.program_id(0)
    g = tl.arange(0, NUM_GROUPS)
    cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = cols < K
    x = tl.load(x_ptr + m * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)  # [NUM_GROUPS]
    if PER_ROW:
        scale = _row_scale_of(tl.max(amax, axis=0), SCALE_UB)
        tl.store(s_ptr + m * stride_sm, scale)
        q = _to_fp8(x, scale)
    else:
        scale = _scale_of(amax)
        tl.store(s_ptr + m * stride_sm + g, scale, mask=g * GROUP < K)
        q = _to_fp8(x, scale[:, None])
    tl.store(q_ptr + m * stride_qm + cols, q, mask=mask)


def quantize_rows(x: torch.Tensor, group: int | None = None,
                  scale_ub: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] fp8, scale fp32): [M, 1] per token (group None), [M, K / group] per group.
    The same numbers as quantize.quantize_per_token / quantize_per_group on CUDA; a row longer than
    MAX_ROW, or a group that is not a power of two, is quantized by those functions. scale_ub: the
    per-token bound on each row's max |x| (quantize_per_token's; not with groups)."""
    m, k = x.shape
    if group is not None and k % group:
        raise ValueError(f"quantize_rows: K = {k} is not a multiple of the group size {group}")
    if group is not None and scale_ub is not None:
        raise ValueError(f"quantize_rows: scale_ub {scale_ub} with group {group}: expected none (it bounds per-token "
                         "scales)")
    pow2 = group is None or group & (group - 1) == 0
    if k > MAX_ROW or not pow2:
        return fq.quantize_per_token(x, scale_ub) if group is None else fq.quantize_per_group(x, group)
    x = x if x.stride(1) == 1 else x.contiguous()
    tile = QUANT_GROUP if group is None else group
    q = torch.empty(m, k, dtype=fq.FP8, device=x.device)
    scale = torch.empty(m, 1 if group is None else k // group, dtype=torch.float32, device=x.device)
    if m:
        num_groups = triton.next_power_of_2(triton.cdiv(k, tile))
        _quantize_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), scale.stride(0), GROUP=tile,
                               NUM_GROUPS=num_groups, PER_ROW=group is None, SCALE_UB=_bound(scale_ub),
                               num_warps=min(16, max(4, num_groups * tile // 1024)))
    return q, scale


# -- the scales after an unscaled GEMM ----------------------------------------------------------

@triton.jit
def _scale_kernel(acc_ptr, sx_ptr, sw_ptr, bias_ptr, y_ptr, N, stride_am, stride_sx, stride_sw, stride_ym,
                  HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (m, n): y[m, n] = acc[m, n] * sx[m] * sw[n] (+ bias[n]), as _channel_kernel's epilogue."""
    m, rn = tl.program_id(0), tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rn < N
    acc = tl.load(acc_ptr + m * stride_am + rn, mask=ok, other=0.0)
    sx = tl.load(sx_ptr + m * stride_sx)
    sw = tl.load(sw_ptr + rn * stride_sw, mask=ok, other=0.0)
    y = acc * sx * sw
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + rn, y.to(y_ptr.dtype.element_ty), mask=ok)


def scale_rows_columns(acc: torch.Tensor, x_scale: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """y [M, N] = acc * x_scale[m] * weight_scale[n] (+ bias) in out_dtype, one launch: the scales of
    an FP8 GEMM run without them (acc [M, N] fp32). x_scale [M, 1] or one; weight_scale [N, 1] or one."""
    m, n = acc.shape
    sx, sw = x_scale.reshape(-1).float(), weight_scale.reshape(-1).float()
    if sx.numel() not in (1, m) or sw.numel() not in (1, n) or acc.dtype != torch.float32:
        raise ValueError(f"scale_rows_columns: acc {acc.dtype} {tuple(acc.shape)}, x_scale {tuple(x_scale.shape)}, "
                         f"weight_scale {tuple(weight_scale.shape)}: expected fp32 acc [M, N] with one scale or one "
                         "per row (x) and per column (weight)")
    y = torch.empty(m, n, dtype=out_dtype, device=acc.device)
    if m:
        block_n = min(1024, triton.next_power_of_2(n))
        _scale_kernel[(m, triton.cdiv(n, block_n))](
            acc, sx, sw, bias if bias is not None else y, y, n, acc.stride(0), int(sx.numel() > 1), int(sw.numel() > 1),
            y.stride(0), HAS_BIAS=bias is not None, BLOCK_N=block_n, num_warps=4)
    return y


# -- the GEMMs -----------------------------------------------------------------------------------

@triton.jit
def _x_tile(x_ptr, x_rows, k, end, sx, row_scale, FUSE_QUANT: tl.constexpr, ONE_ROW: tl.constexpr,
            EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """_channel_kernel's fp8 x tile [BLOCK_M, BLOCK_K] at columns k (zeros from `end` on unless EVEN_K):
    loaded, and quantized with the rows' scales sx (ONE_ROW: the one row's row_scale, broadcast)."""
    if FUSE_QUANT and ONE_ROW:
        row = tl.load(x_ptr + k, mask=k < end, other=0.0).to(tl.float32)
        return tl.broadcast_to(_to_fp8(row, row_scale)[None, :], (BLOCK_M, BLOCK_K))
    if EVEN_K:
        a = tl.load(x_rows + k[None, :])
    else:
        a = tl.load(x_rows + k[None, :], mask=k[None, :] < end, other=0.0)
    if FUSE_QUANT:
        a = _to_fp8(a.to(tl.float32), sx[:, None])
    return a


@triton.jit
def _channel_kernel(x_ptr, sx_ptr, w_ptr, sw_ptr, bias_ptr, y_ptr, ws_ptr, counters_ptr, M, N, K, split_k,
                    stride_xm, stride_sx, stride_wn, stride_sw, stride_ym, HAS_BIAS: tl.constexpr,
                    FUSE_QUANT: tl.constexpr, ONE_ROW: tl.constexpr, EVEN_K: tl.constexpr, SCALE_UB: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, AMAX_COLS: tl.constexpr,
                    AMAX_STEPS: tl.constexpr, PDL: tl.constexpr, GDC: tl.constexpr):
    """Program (n, s, m): output tile m x n over K slice s. x fp8 [M, K] with scales sx (stride 0:
    one scale), or (FUSE_QUANT) x in the model dtype, quantized per row here: first the rows' maxima
    over all of K (bounded by SCALE_UB unless 0), then each K step as it is loaded. ONE_ROW (M = 1):
    x is quantized as one row and broadcast to the tile's rows, not BLOCK_M copies of it. w [N, K] fp8.
    PDL: the slice's first weight tile is loaded before anything the previous kernel writes (then
    _wait_for_inputs, with GDC), and its step is taken before the loop: the same sums in the same order."""
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rm_in, rn_in = tl.minimum(rm, M - 1), tl.minimum(rn, N - 1)  # loads past an edge repeat its last row
    x_rows = x_ptr + rm_in[:, None] * stride_xm
    w_rows = w_ptr + rn_in[None, :] * stride_wn
    steps = tl.cdiv(K, BLOCK_K)
    first = pid_k * tl.cdiv(steps, split_k)
    last = tl.minimum(first + tl.cdiv(steps, split_k), steps)
    if PDL:  # NOTE: masked at the slice's end: a slice of a split may be empty
        k_first = first * BLOCK_K + rk
        end = tl.minimum(K, last * BLOCK_K)
        b_first = tl.load(w_rows + k_first[:, None], mask=k_first[:, None] < end, other=0.0)
    _wait_for_inputs(GDC)
    row_scale = 1.0
    if FUSE_QUANT and ONE_ROW:
        first_row = tl.zeros((1,), dtype=tl.int32)
        amax = tl.max(_rows_amax(x_ptr, first_row, stride_xm, K, 1, AMAX_COLS, AMAX_STEPS), axis=0)
        row_scale = _row_scale_of(amax, SCALE_UB)
        sx = tl.zeros((BLOCK_M,), dtype=tl.float32) + row_scale
    elif FUSE_QUANT:
        sx = _row_scale_of(_rows_amax(x_ptr, rm_in, stride_xm, K, BLOCK_M, AMAX_COLS, AMAX_STEPS), SCALE_UB)
    else:
        sx = tl.load(sx_ptr + rm_in * stride_sx)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    start = first
    if PDL:
        a = _x_tile(x_ptr, x_rows, k_first, end, sx, row_scale, FUSE_QUANT, ONE_ROW, False, BLOCK_M, BLOCK_K)
        acc += tl.dot(a, b_first)
        start = first + 1
    for step in range(start, last):
        k = step * BLOCK_K + rk
        a = _x_tile(x_ptr, x_rows, k, K, sx, row_scale, FUSE_QUANT, ONE_ROW, EVEN_K, BLOCK_M, BLOCK_K)
        if EVEN_K:
            b = tl.load(w_rows + k[:, None])  # [BLOCK_K, BLOCK_N]
        else:
            b = tl.load(w_rows + k[:, None], mask=k[:, None] < K, other=0.0)
        # Hopper's FP8 wgmma (64-row tiles) accumulates in reduced precision: accumulating into `acc`
        # across K left 64-row tiles off by up to 0.066 at K = 4096 on an H100, while 16- and 32-row
        # tiles (mma) and the block kernel (a fresh dot per K block) were exact. So each K block's
        # dot starts from zero and is added in fp32. (max_num_imprecise_acc=32 failed to compile for
        # 64 x 256 tiles with triton 3.6: "Cannot use F32 as the accumulator ... less than 32".)
        acc += tl.dot(a, b)
    sw = tl.load(sw_ptr + rn_in * stride_sw)
    acc = acc * sx[:, None] * sw[None, :]
    _store_result(acc, bias_ptr, y_ptr, ws_ptr, counters_ptr, rm, rn, M, N, stride_ym, pid_k, split_k,
                  pid_m * tl.num_programs(0) + pid_n, HAS_BIAS, BLOCK_M, BLOCK_N)


@triton.jit
def _block_kernel(x_ptr, sx_ptr, w_ptr, sw_ptr, bias_ptr, y_ptr, ws_ptr, counters_ptr, M, N, K, split_k,
                  stride_xm, stride_sxm, stride_wn, stride_swn, stride_ym, HAS_BIAS: tl.constexpr,
                  FUSE_QUANT: tl.constexpr, ONE_ROW: tl.constexpr, SCALE_ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr, GDC: tl.constexpr):
    """Program (n, s, m) as in _channel_kernel; BLOCK_K is the weight block's columns (the activation
    group), K a multiple of it; SCALE_ROWS the weight block's rows. x fp8 with group scales sx
    [M, K / BLOCK_K], or (FUSE_QUANT) in the model dtype, each group quantized as it is loaded.
    PDL: only the wait (GDC), before the loop."""
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rm_in, rn_in = tl.minimum(rm, M - 1), tl.minimum(rn, N - 1)
    x_rows = x_ptr + rm_in[:, None] * stride_xm
    w_rows = w_ptr + rn_in[None, :] * stride_wn
    sw_rows = sw_ptr + (rn_in // SCALE_ROWS) * stride_swn  # [BLOCK_N]: each column's weight block row
    steps = K // BLOCK_K
    first = pid_k * tl.cdiv(steps, split_k)
    last = tl.minimum(first + tl.cdiv(steps, split_k), steps)
    _wait_for_inputs(GDC)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(first, last):
        k = step * BLOCK_K + rk
        if FUSE_QUANT and ONE_ROW:
            row = tl.load(x_ptr + k).to(tl.float32)
            group_scale = _scale_of(tl.max(tl.abs(row), axis=0))
            a = tl.broadcast_to(_to_fp8(row, group_scale)[None, :], (BLOCK_M, BLOCK_K))
            a_s = tl.zeros((BLOCK_M,), dtype=tl.float32) + group_scale
        elif FUSE_QUANT:
            a32 = tl.load(x_rows + k[None, :]).to(tl.float32)
            a_s = _scale_of(tl.max(tl.abs(a32), axis=1))
            a = _to_fp8(a32, a_s[:, None])
        else:
            a = tl.load(x_rows + k[None, :])
            a_s = tl.load(sx_ptr + rm_in * stride_sxm + step)
        b = tl.load(w_rows + k[:, None])
        b_s = tl.load(sw_rows + step)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
    _store_result(acc, bias_ptr, y_ptr, ws_ptr, counters_ptr, rm, rn, M, N, stride_ym, pid_k, split_k,
                  pid_m * tl.num_programs(0) + pid_n, HAS_BIAS, BLOCK_M, BLOCK_N)


# -- the GEMVs: M up to GEMV_MAX_ROWS, no tl.dot ----------------------------------------------------
#
# tl.dot pads M to 16 rows and takes the weight as [BLOCK_K, BLOCK_N]; at M <= 8 the GEMVs instead
# load each weight tile [BLOCK_N, BLOCK_K] as it is stored (K contiguous: 16-byte loads), convert
# it to fp32 once and, for each row of x (ROWS = M, unrolled), multiply by the row's fp8 values
# and sum over K. The products of two e4m3 values are exact in fp32; only the order of the fp32
# sums differs from the tl.dot kernels. One program per BLOCK_N columns and K slice; split K and
# the epilogue are _store_result's. The accumulator is held transposed, [BLOCK_N, BLOCK_M], so that
# each row's sum over K ([BLOCK_N], reduced from the weight tile) adds to it without a change of
# layout; it is transposed once, for the store. NOTE: Triton's pipeliner leaves these loads alone
# (they feed no tl.dot: no cp.async in the compiled kernels, triton 3.9 for sm_90), so PREFETCH
# (a launch's num_stages > 1) loads the next K step's weight tile into registers while the current
# one is summed; with num_stages 1 each step waits for its own tile.

@triton.jit
def _weight_tile(w_rows, k, end, MASKED: tl.constexpr):
    """The fp8 weight tile [BLOCK_N, BLOCK_K] at columns k, as stored; with MASKED only columns below
    end (K, or the end of the program's K slice: a prefetch past it reads nothing). NOTE: Triton
    keeps 16-byte loads under the mask where end is a multiple of 16 (K's divisibility is known)."""
    if MASKED:
        return tl.load(w_rows + k[None, :], mask=k[None, :] < end, other=0.0)
    return tl.load(w_rows + k[None, :])


@triton.jit
def _rows_amax(x_ptr, rows, stride_xm, K, ROWS_PAD: tl.constexpr, AMAX_COLS: tl.constexpr,
               AMAX_STEPS: tl.constexpr):
    """Each row's max |x| over all of K ([ROWS_PAD], fp32): AMAX_STEPS loads of [ROWS_PAD, AMAX_COLS]
    (amax_tiles), unrolled so that they are in flight together. A loop over K waited for each load's
    L2 round trip in turn before the GEMM's first weight tile was asked for."""
    cols = tl.arange(0, AMAX_COLS)
    amax = tl.zeros((ROWS_PAD, AMAX_COLS), dtype=tl.float32)
    for step in tl.static_range(AMAX_STEPS):
        k = step * AMAX_COLS + cols
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=k[None, :] < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    return tl.max(amax, axis=1)


@triton.jit
def _pick(values, rows, r: tl.constexpr):
    """values [BLOCK_M] -> its entry r (a scalar; the other entries add zeros, so exactly it)."""
    return tl.sum(tl.where(rows == r, values, 0.0), axis=0)


@triton.jit
def _pick_row(tile, rows, r: tl.constexpr):
    """tile [BLOCK_M, BLOCK_K] -> its row r [BLOCK_K] (the other rows add zeros, so exactly it)."""
    return tl.sum(tl.where(rows[:, None] == r, tile, 0.0), axis=0)


@triton.jit
def _add_row(acc_t, rows, r: tl.constexpr, part):
    """acc_t [BLOCK_N, BLOCK_M] (transposed) with part [BLOCK_N] added to its column r."""
    return acc_t + tl.where(rows[None, :] == r, part[:, None], 0.0)


@triton.jit
def _channel_gemv_kernel(x_ptr, sx_ptr, w_ptr, sw_ptr, bias_ptr, y_ptr, ws_ptr, counters_ptr, M, N, K, split_k,
                         stride_xm, stride_sx, stride_wn, stride_sw, stride_ym, HAS_BIAS: tl.constexpr,
                         FUSE_QUANT: tl.constexpr, EVEN_K: tl.constexpr, SCALE_UB: tl.constexpr, ROWS: tl.constexpr,
                         PREFETCH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, AMAX_COLS: tl.constexpr, AMAX_STEPS: tl.constexpr,
                         PDL: tl.constexpr, GDC: tl.constexpr):
    """Program (n, s): columns n of all ROWS (= M) rows over K slice s; x and its scales as in
    _channel_kernel (FUSE_QUANT: each row's max over all of K first, the same scale), BLOCK_M the
    rows padded to a power of two. PDL: the prefetched first weight tile is asked for before x's
    maxima and before _wait_for_inputs (GDC)."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rm_in, rn_in = tl.minimum(rm, M - 1), tl.minimum(rn, N - 1)
    w_rows = w_ptr + rn_in[:, None] * stride_wn  # [BLOCK_N, 1]: the weight as stored, K contiguous
    steps = tl.cdiv(K, BLOCK_K)
    first = pid_k * tl.cdiv(steps, split_k)
    last = tl.minimum(first + tl.cdiv(steps, split_k), steps)
    end = tl.minimum(K, last * BLOCK_K)  # the K slice's end: no prefetch past it
    if PREFETCH and PDL:
        w_next = _weight_tile(w_rows, first * BLOCK_K + rk, end, True)
    _wait_for_inputs(GDC)
    if FUSE_QUANT:
        sx = _row_scale_of(_rows_amax(x_ptr, rm_in, stride_xm, K, BLOCK_M, AMAX_COLS, AMAX_STEPS), SCALE_UB)
    else:
        sx = tl.load(sx_ptr + rm_in * stride_sx)
    acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    x_rows = x_ptr + rm_in[:, None] * stride_xm  # [BLOCK_M, 1]
    if PREFETCH:  # NOTE: x's rows too: plain loads, never pipelined by Triton, each step would wait for L2
        if not PDL:
            w_next = _weight_tile(w_rows, first * BLOCK_K + rk, end, True)
        x_next = _weight_tile(x_rows, first * BLOCK_K + rk, end, True)
    for step in range(first, last):
        k = step * BLOCK_K + rk
        if PREFETCH:
            w, x_tile = w_next.to(tl.float32), x_next.to(tl.float32)  # [BLOCK_N, BLOCK_K], [BLOCK_M, BLOCK_K]
            w_next = _weight_tile(w_rows, k + BLOCK_K, end, True)
            x_next = _weight_tile(x_rows, k + BLOCK_K, end, True)
        else:
            w = _weight_tile(w_rows, k, K, not EVEN_K).to(tl.float32)
        for r in tl.static_range(ROWS):
            if PREFETCH:
                a = _pick_row(x_tile, rm, r)
            elif EVEN_K:
                a = tl.load(x_ptr + r * stride_xm + k).to(tl.float32)
            else:
                a = tl.load(x_ptr + r * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
            if FUSE_QUANT:
                a = _to_fp8(a, _pick(sx, rm, r)).to(tl.float32)
            acc_t = _add_row(acc_t, rm, r, tl.sum(w * a[None, :], axis=1))
    sw = tl.load(sw_ptr + rn_in * stride_sw)
    acc = tl.trans(acc_t * sx[None, :] * sw[:, None])
    _store_result(acc, bias_ptr, y_ptr, ws_ptr, counters_ptr, rm, rn, M, N, stride_ym, pid_k, split_k, pid_n,
                  HAS_BIAS, BLOCK_M, BLOCK_N)


@triton.jit
def _block_gemv_kernel(x_ptr, sx_ptr, w_ptr, sw_ptr, bias_ptr, y_ptr, ws_ptr, counters_ptr, M, N, K, split_k,
                       stride_xm, stride_sxm, stride_wn, stride_swn, stride_ym, HAS_BIAS: tl.constexpr,
                       FUSE_QUANT: tl.constexpr, SCALE_ROWS: tl.constexpr, ROWS: tl.constexpr, PREFETCH: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                       GDC: tl.constexpr):
    """Program (n, s) as in _channel_gemv_kernel, with _block_kernel's operands: BLOCK_K the weight
    block's columns (one K step per block), each step's sum scaled by its two block scales. The
    prefetch (weights and their scales only) comes before _wait_for_inputs (GDC) either way."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rn_in = tl.minimum(rn, N - 1)
    w_rows = w_ptr + rn_in[:, None] * stride_wn
    sw_rows = sw_ptr + (rn_in // SCALE_ROWS) * stride_swn
    steps = K // BLOCK_K
    first = pid_k * tl.cdiv(steps, split_k)
    last = tl.minimum(first + tl.cdiv(steps, split_k), steps)
    acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    end = last * BLOCK_K  # the K slice's end: no prefetch past it
    if PREFETCH:
        w_next = _weight_tile(w_rows, first * BLOCK_K + rk, end, True)
        b_next = tl.load(sw_rows + tl.minimum(first, steps - 1))
    _wait_for_inputs(GDC)
    for step in range(first, last):
        k = step * BLOCK_K + rk
        if PREFETCH:
            w, b_s = w_next.to(tl.float32), b_next  # [BLOCK_N, BLOCK_K], [BLOCK_N]
            w_next = _weight_tile(w_rows, k + BLOCK_K, end, True)
            b_next = tl.load(sw_rows + tl.minimum(step + 1, steps - 1))  # NOTE: the scales are tiny (L2)
        else:
            w, b_s = _weight_tile(w_rows, k, K, False).to(tl.float32), tl.load(sw_rows + step)
        for r in tl.static_range(ROWS):
            a = tl.load(x_ptr + r * stride_xm + k).to(tl.float32)
            if FUSE_QUANT:
                a_s = _scale_of(tl.max(tl.abs(a), axis=0))
                a = _to_fp8(a, a_s).to(tl.float32)
            else:
                a_s = tl.load(sx_ptr + r * stride_sxm + step)
            acc_t = _add_row(acc_t, rm, r, tl.sum(w * a[None, :], axis=1) * a_s * b_s)
    _store_result(tl.trans(acc_t), bias_ptr, y_ptr, ws_ptr, counters_ptr, rm, rn, M, N, stride_ym, pid_k, split_k, pid_n,
                  HAS_BIAS, BLOCK_M, BLOCK_N)


def new_counters(weight: torch.Tensor) -> torch.Tensor:
    """The split-K tile counters of one weight [N, K]: int32 zeros, one per MIN_BLOCK_N columns. The
    GEMMs leave them at zero, so a layer can keep one buffer for every call (one stream at a time)."""
    return torch.zeros(triton.cdiv(weight.shape[0], MIN_BLOCK_N), dtype=torch.int32, device=weight.device)


def channel_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                   launch: Launch, counters: torch.Tensor | None = None, x_scale: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None, scale_ub: float | None = None,
                   pdl: bool = True) -> torch.Tensor:
    """y [M, N] = (xq @ weight^T) * sx * weight_scale (+ bias), in out_dtype (default x's dtype).

    x [M, K]: in the model dtype, quantized here per token (each row's max |x| bounded by scale_ub
    when given); or fp8 with x_scale [M, 1] or [] (per tensor). weight [N, K] fp8 row-major;
    weight_scale [N, 1] or [] fp32; bias [N]. counters: from new_counters(weight), else zeros are
    allocated when the launch splits K. pdl: launch with programmatic dependent launch where the GPU
    has it (pdl_device), the weight's first tile read before the previous kernel ends."""
    out_dtype = out_dtype or x.dtype
    sw = weight_scale.reshape(-1)
    if sw.numel() not in (1, weight.shape[0]) or (x_scale is not None and x_scale.numel() not in (1, x.shape[0])):
        raise ValueError(f"channel_matmul: weight_scale {tuple(weight_scale.shape)}, x_scale "
                         f"{None if x_scale is None else tuple(x_scale.shape)}: expected one scale or one per "
                         "output channel (weight) and per token (x)")
    if x_scale is None and not launch.fuse_quant:
        x, x_scale = quantize_rows(x, scale_ub=scale_ub)
    sx = x_scale.reshape(-1) if x_scale is not None else sw  # unread when x is quantized in the GEMM
    gemv = _gemv("channel_matmul", launch, x.shape[0])
    kernel = _channel_gemv_kernel if gemv else _channel_kernel
    amax_rows = triton.next_power_of_2(x.shape[0]) if gemv else (1 if x.shape[0] == 1 else block_m_for(x.shape[0]))
    return _launch(kernel, x, sx, weight, sw, bias, launch, counters, out_dtype,
                   launch.block_k, dict(EVEN_K=x.shape[1] % launch.block_k == 0, SCALE_UB=_bound(scale_ub),
                                        **amax_tiles(amax_rows, x.shape[1])),
                   (int(sx.numel() > 1), int(sw.numel() > 1)), pdl)


def amax_tiles(rows: int, k: int) -> dict:
    """The fused quantization's pre-pass over x (_rows_amax): AMAX_STEPS tiles of [rows, AMAX_COLS],
    about 4096 elements each (32 a thread at 4 warps), all of K."""
    cols = max(16, min(triton.next_power_of_2(max(k, 1)), AMAX_ELEMENTS // rows))
    return dict(AMAX_COLS=cols, AMAX_STEPS=triton.cdiv(max(k, 1), cols))


def _gemv(name: str, launch: Launch, m: int) -> bool:
    """Whether `launch` runs the GEMV kernel at M rows; a ValueError past GEMV_MAX_ROWS."""
    if launch.gemv and m > GEMV_MAX_ROWS:
        raise ValueError(f"{name}: {launch} is a GEMV launch, for M up to {GEMV_MAX_ROWS} rows; got M = {m}: "
                         "expected gemv=False at this M")
    return launch.gemv


def _bound(scale_ub: float | None) -> float:
    """The kernels' SCALE_UB constant: the bound, or 0.0 for none."""
    if scale_ub is not None and not scale_ub > 0:
        raise ValueError(f"scale_ub {scale_ub}: expected a bound > 0 on the rows' max |x|, or None")
    return 0.0 if scale_ub is None else float(scale_ub)


def block_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int],
                 bias: torch.Tensor | None, launch: Launch, counters: torch.Tensor | None = None,
                 x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                 pdl: bool = True) -> torch.Tensor:
    """y [M, N] = sum over K blocks of (xq @ weight^T) * x_scale * weight_scale (+ bias).

    x [M, K]: in the model dtype, quantized here per 1 x bk group; or fp8 with x_scale [M, K / bk].
    weight [N, K] fp8; weight_scale [ceil(N / bn), K / bk] fp32 (block = (bn, bk)); bias [N]; pdl as in
    channel_matmul."""
    block_n, block_k = block
    k = x.shape[1]
    if k % block_k or block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"block_matmul: weight block {block} over K = {k}: expected the block's columns to be "
                         "a power of two >= 16 that divides K")
    out_dtype = out_dtype or x.dtype
    if x_scale is None and not launch.fuse_quant:
        x, x_scale = quantize_rows(x, block_k)
    sx = x_scale if x_scale is not None else weight_scale  # unread with fuse_quant
    sw = weight_scale if weight_scale.is_contiguous() else weight_scale.contiguous()
    kernel = _block_gemv_kernel if _gemv("block_matmul", launch, x.shape[0]) else _block_kernel
    return _launch(kernel, x, sx, weight, sw, bias, launch, counters, out_dtype, block_k,
                   dict(SCALE_ROWS=block_n), (sx.stride(0), sw.stride(0)), pdl)


def _launch(kernel, x, sx, weight, sw, bias, launch: Launch, counters, out_dtype, block_k: int, constants: dict,
            scale_strides: tuple[int, int], pdl: bool) -> torch.Tensor:
    """Launch one GEMM over the grid (N tiles, K slices, M tiles); K is split only with one M tile.
    A GEMV launch: one M tile of every row (ROWS = M). pdl: the kernels' PDL order of loads on any
    device (so the interpreter tests it), the wait and the launch attribute where pdl_device."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m == 0:
        return y
    x = x if x.stride(1) == 1 else x.contiguous()
    if launch.gemv:
        block_m = triton.next_power_of_2(m)
        constants = dict(constants, ROWS=m, PREFETCH=launch.num_stages > 1)
    else:
        block_m = block_m_for(m)
        constants = dict(constants, ONE_ROW=m == 1)
    grid_m, n_tiles = triton.cdiv(m, block_m), triton.cdiv(n, launch.block_n)
    split = min(launch.split_k, triton.cdiv(k, block_k)) if grid_m == 1 else 1
    ws = torch.empty(split if split > 1 else 0, m, n, dtype=torch.float32, device=x.device)
    counters = _counters(counters, n_tiles, x.device) if split > 1 else torch.empty(0, dtype=torch.int32, device=x.device)
    gdc = pdl and pdl_device(x.device)
    extra = dict(launch_pdl=True) if gdc else {}
    kernel[(n_tiles, split, grid_m)](
        x, sx, weight, sw, bias if bias is not None else y, y, ws, counters, m, n, k, split,
        x.stride(0), scale_strides[0], weight.stride(0), scale_strides[1], y.stride(0),
        HAS_BIAS=bias is not None, FUSE_QUANT=x.dtype != fq.FP8, BLOCK_M=block_m, BLOCK_N=launch.block_n,
        BLOCK_K=block_k, PDL=pdl, GDC=gdc, num_warps=launch.num_warps, num_stages=launch.num_stages, **extra,
        **constants)
    return y


def pdl_device(device: torch.device) -> bool:
    """Whether kernels on `device` launch with programmatic dependent launch: a CUDA GPU of compute
    capability 9.0 or newer (Hopper's griddepcontrol) and a Triton that sets the launch attribute."""
    return device.type == "cuda" and _pdl_capable(device.index if device.index is not None else
                                                  torch.cuda.current_device())


@functools.cache
def _pdl_capable(index: int) -> bool:
    if INTERPRETED or torch.version.cuda is None or torch.cuda.get_device_capability(index) < (9, 0):
        return False  # NOTE: a ROCm build reports "cuda" devices of capability 9.x too
    if not hasattr(tl.extra.cuda, "gdc_wait"):
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # NOTE: a Triton without the NVIDIA backend launches nothing on CUDA anyway
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def _counters(counters: torch.Tensor | None, n_tiles: int, device: torch.device) -> torch.Tensor:
    if counters is None:
        return torch.zeros(n_tiles, dtype=torch.int32, device=device)
    if counters.dtype != torch.int32 or counters.numel() < n_tiles or counters.device != device:
        raise ValueError(f"split-K counters: int32 [{counters.numel()}] on {counters.device}: expected int32 with at "
                         f"least {n_tiles} entries on {device} (new_counters(weight))")
    return counters
