"""Triton device functions shared by the decode and extend kernels.

Scores are kept in log2 units (scaled by log2(e)) so the online softmax can use exp2.

FP8 KV cache: tiles are used in the pool's units (the stored float8 values, converted to q's dtype
exactly) and the layer's scales are applied outside the products: the kernels pass
sm_scale * k_scale as the score scale and multiply the normalised output by v_scale.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def tanh(x):
    """tanh through exp; exp overflow gives 1 and underflow gives -1, so no NaN at either end."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def scores_log2(qk, sm_scale, softcap, USE_SOFTCAP: tl.constexpr):
    """Raw q.k products -> scaled (and soft-capped) scores in log2 units."""
    if USE_SOFTCAP:
        s = (softcap * LOG2E) * tanh(qk * (sm_scale / softcap))
    else:
        s = qk * (sm_scale * LOG2E)
    return s


@triton.jit
def gather_kv_tile(row_ptr, K_buf, V_buf, kv_head, offs_n, mask_n, offs_d, mask_d, offs_dv, mask_dv,
                   stride_kt, stride_kh, stride_vt, stride_vh):
    """The keys (transposed, [D, N]) and values ([N, DV]) of one KV head at the request positions
    offs_n, read through the request's req_to_token row (page size 1: one slot per position)."""
    slots = tl.load(row_ptr + offs_n, mask=mask_n, other=0).to(tl.int64)
    k_t = tl.load(K_buf + slots[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
                  mask=mask_n[None, :] & mask_d[:, None], other=0.0)
    v = tl.load(V_buf + slots[:, None] * stride_vt + kv_head * stride_vh + offs_dv[None, :],
                mask=mask_n[:, None] & mask_dv[None, :], other=0.0)
    return k_t, v


@triton.jit
def attend_tile(
    q,
    k_t,
    v,
    visible,
    acc,
    l_i,
    m_i,
    sm_scale,
    softcap,
    USE_SOFTCAP: tl.constexpr,
    APPLY_MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over a tile of keys.

    q: [M, D]; k_t: [D, N]; v: [N, DV] (q's dtype or float8, converted to q's); visible: bool
    broadcastable to [M, N] (read only when APPLY_MASK); acc: [M, DV] fp32 (unnormalised); l_i, m_i:
    [M] fp32 running sum and max (log2). Rows that have seen no visible key keep m_i = -inf, l_i = 0
    and acc = 0.
    """
    qk = tl.dot(q, k_t.to(q.dtype), input_precision=DOT_PRECISION)
    s = scores_log2(qk, sm_scale, softcap, USE_SOFTCAP)
    if APPLY_MASK:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # NOTE: a row with nothing visible yet has m_new = -inf; subtracting 0 instead keeps exp2 at 0.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    l_i = l_i * alpha + tl.sum(p, 1)
    return acc, l_i, m_new
