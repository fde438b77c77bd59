"""Extend (prefill) attention: new tokens attend to their cached prefix and to each other.

Grid (num_heads, ceil(max_q_len / BLOCK_M), batch). A program takes BLOCK_M new queries of one
head of one request: first the request's prefix keys, gathered from the page-size-1 pool through
req_to_token, then the new keys from the contiguous k/v tensors. Without a custom mask the new
keys are causal: key blocks wholly below the diagonal run without a mask and only the diagonal
blocks are masked. With a custom mask (tree masks of TARGET_VERIFY, DRAFT_EXTEND) the mask
replaces causality for prefix and new keys alike. Sliding window and soft-cap apply on top.
The window compares positions: without a custom mask a new token's position is prefix + its index;
with one the new tokens may be the nodes of a draft tree (node i at num_cached + depth(i), not
num_cached + i), so a windowed layer reads the positions of the queries and of the new keys
(`positions`); prefix keys are at their indices.
Over an FP8 pool the new keys and values come quantized as the pool stores them (float8), so a
token attends to the same values whether it is new or cached.
Heads vary fastest across programs so the heads of one KV group share K/V tiles in L2, and the
longest (last) query blocks of a request start first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import ExtendConfig, dot_precision, extend_config
from .tile_ops import attend_tile, gather_kv_tile


@triton.jit
def _visible(key_col, key_pos, q_pos, mask_n, Mask, mask_row, mask_m, window,
             USE_MASK: tl.constexpr, USE_WINDOW: tl.constexpr):
    """[BLOCK_M, BLOCK_N] keys each query may see: key_col is the keys' column in the custom mask
    (their index in the request), key_pos their positions, q_pos the queries'."""
    vis = mask_n[None, :] & mask_m[:, None]
    if USE_MASK:
        allowed = tl.load(Mask + mask_row[:, None] + key_col[None, :], mask=vis, other=0)
        vis = vis & (allowed != 0)
    if USE_WINDOW:
        vis = vis & (key_pos[None, :] > q_pos[:, None] - window)
    return vis


@triton.jit
def _extend_kernel(
    Q, K_new, V_new, O, K_buf, V_buf, Req_to_token, Req_pool_indices, Qo_indptr, Prefix_lens,
    Mask, Mask_indptr, Positions, sm_scale, k_scale, v_scale, softcap, window,
    stride_qt, stride_qh, stride_knt, stride_knh, stride_vnt, stride_vnh, stride_ot, stride_oh,
    stride_kbt, stride_kbh, stride_vbt, stride_vbh, stride_req,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, USE_MASK: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, USE_POSITIONS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    head = tl.program_id(0)
    qk_scale = sm_scale * k_scale  # keys are stored values times k_scale (1.0 unless the pool is FP8)
    m_block = tl.num_programs(1) - 1 - tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(Qo_indptr + b).to(tl.int32)
    q_len = tl.load(Qo_indptr + b + 1).to(tl.int32) - q_start
    if m_block * BLOCK_M < q_len:
        kv_head = head // GROUP
        prefix = tl.load(Prefix_lens + b).to(tl.int32)
        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < q_len
        tokens = (q_start + offs_m).to(tl.int64)
        q_pos = prefix + offs_m
        if USE_POSITIONS:  # a draft tree: node i sits at num_cached + depth(i)
            q_pos = tl.load(Positions + tokens, mask=mask_m, other=0).to(tl.int32)
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        offs_dv = tl.arange(0, BLOCK_DV)
        mask_dv = offs_dv < V_DIM
        # q: [BLOCK_M, BLOCK_D]
        q = tl.load(Q + tokens[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                    mask=mask_m[:, None] & mask_d[None, :], other=0.0)
        mask_row = offs_m.to(tl.int64) * 0
        if USE_MASK:
            mask_row = tl.load(Mask_indptr + b).to(tl.int64) + offs_m.to(tl.int64) * (prefix + q_len)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

        # Phase 1: the prefix, gathered from the pool.
        lo = 0
        if USE_WINDOW:  # the block's first query position is its lowest (for a tree, the lowest loaded)
            first_pos = prefix + m_block * BLOCK_M
            if USE_POSITIONS:
                first_pos = tl.min(tl.where(mask_m, q_pos, prefix + q_len), 0)
            lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
        row_ptr = Req_to_token + tl.load(Req_pool_indices + b).to(tl.int64) * stride_req
        for start_n in range(lo, prefix, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            mask_n = offs_n < prefix
            k_t, v = gather_kv_tile(row_ptr, K_buf, V_buf, kv_head, offs_n, mask_n, offs_d, mask_d, offs_dv,
                                    mask_dv, stride_kbt, stride_kbh, stride_vbt, stride_vbh)
            vis = _visible(offs_n, offs_n, q_pos, mask_n, Mask, mask_row, mask_m, window, USE_MASK, USE_WINDOW)
            acc, l_i, m_i = attend_tile(q, k_t, v, vis, acc, l_i, m_i, qk_scale, softcap,
                                        USE_SOFTCAP, True, DOT_PRECISION)

        # Phase 2: the new tokens, from the contiguous k/v.
        lo_new = 0
        if USE_WINDOW and not USE_POSITIONS:  # (a tree's ancestors of a node may sit anywhere before it)
            lo_new = tl.maximum(m_block * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
        end_new = q_len
        full_end = lo_new  # keys in [lo_new, full_end) need no mask: causal only, no window or custom mask
        if not USE_MASK:
            end_new = tl.minimum(q_len, (m_block + 1) * BLOCK_M)
            if not USE_WINDOW:
                full_end = m_block * BLOCK_M
        k_new_ptr = K_new + kv_head * stride_knh + offs_d[:, None]
        v_new_ptr = V_new + kv_head * stride_vnh + offs_dv[None, :]
        for start_n in range(lo_new, full_end, BLOCK_N):
            keys = (q_start + start_n + tl.arange(0, BLOCK_N)).to(tl.int64)
            k_t = tl.load(k_new_ptr + keys[None, :] * stride_knt, mask=mask_d[:, None], other=0.0)
            v = tl.load(v_new_ptr + keys[:, None] * stride_vnt, mask=mask_dv[None, :], other=0.0)
            acc, l_i, m_i = attend_tile(q, k_t, v, mask_m[:, None], acc, l_i, m_i, qk_scale, softcap,
                                        USE_SOFTCAP, False, DOT_PRECISION)
        for start_n in range(full_end, end_new, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            mask_n = offs_n < q_len
            keys = (q_start + offs_n).to(tl.int64)
            k_t = tl.load(k_new_ptr + keys[None, :] * stride_knt, mask=mask_n[None, :] & mask_d[:, None],
                          other=0.0)
            v = tl.load(v_new_ptr + keys[:, None] * stride_vnt, mask=mask_n[:, None] & mask_dv[None, :],
                        other=0.0)
            key_pos = prefix + offs_n
            if USE_POSITIONS:
                key_pos = tl.load(Positions + keys, mask=mask_n, other=0).to(tl.int32)
            vis = _visible(prefix + offs_n, key_pos, q_pos, mask_n, Mask, mask_row, mask_m, window,
                           USE_MASK, USE_WINDOW)
            if not USE_MASK:
                vis = vis & (offs_n[None, :] <= offs_m[:, None])
            acc, l_i, m_i = attend_tile(q, k_t, v, vis, acc, l_i, m_i, qk_scale, softcap,
                                        USE_SOFTCAP, True, DOT_PRECISION)

        # Rows that saw no key at all (possible only under a custom mask) output zeros.
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None] * v_scale
        tl.store(O + tokens[:, None] * stride_ot + head * stride_oh + offs_dv[None, :],
                 out.to(O.dtype.element_ty), mask=mask_m[:, None] & mask_dv[None, :])


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    qo_indptr: torch.Tensor,
    prefix_lens: torch.Tensor,
    max_q_len: int,
    scaling: float,
    softcap: float = 0.0,
    window: int = 0,
    custom_mask: torch.Tensor | None = None,
    mask_indptr: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    config: ExtendConfig | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of each request's new tokens over its prefix and the new tokens; writes and returns `o`.

    q: [num_tokens, num_heads, head_dim]; o: [num_tokens, num_heads, v_dim] (q's dtype)
    k: [num_tokens, num_kv_heads, head_dim]; v: [num_tokens, num_kv_heads, v_dim], the new tokens (q's
      dtype, or over an FP8 pool float8 as the pool stores them)
    k_buffer, v_buffer: [num_slots + 1, num_kv_heads, head_dim / v_dim], the pool holding the prefixes
    req_to_token: [rows, max_context_len] int32; req_pool_indices: [bs] int, the request's row
    qo_indptr: [bs + 1] int, request b's new tokens are rows qo_indptr[b]:qo_indptr[b+1]
    prefix_lens: [bs] int, cached tokens per request (positions 0..prefix-1 of its req_to_token row)
    max_q_len: an upper bound of the new tokens of any request (sets the grid)
    custom_mask: flat bool; request b holds a row-major [q_len, prefix + q_len] mask from
      mask_indptr[b] ([bs + 1] int), True = visible; it replaces causality
    softcap: 0 for none; window: key p visible from query position t when p > t - window, 0 for none
    positions: [num_tokens] int, the new tokens' positions, read by a windowed layer under a custom
      mask (a draft tree's nodes are not at prefix + index); None: prefix + index
    k_scale, v_scale: what the stored keys and values (pool and float8 new ones) are multiplied by
    """
    num_tokens, num_heads, head_dim = q.shape
    bs = prefix_lens.shape[0]
    num_kv_heads, v_dim = k.shape[1], v.shape[2]
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1, "head_dim must be contiguous"
    assert k_buffer.stride(2) == v_buffer.stride(2) == 1, "pool head_dim must be contiguous"
    cfg = config or extend_config(head_dim, q.dtype, q.device)
    assert cfg.block_m % cfg.block_n == 0, f"block_m {cfg.block_m} must be a multiple of block_n {cfg.block_n}"
    use_mask = custom_mask is not None
    if use_mask:
        assert mask_indptr is not None, "custom_mask needs mask_indptr"
    use_positions = use_mask and window > 0 and positions is not None
    if use_positions and positions.shape[0] < num_tokens:
        raise ValueError(f"triton attention: expected a position for each of the {num_tokens} new tokens, "
                         f"got {positions.shape[0]}")
    grid = (num_heads, triton.cdiv(max(max_q_len, 1), cfg.block_m), bs)
    _extend_kernel[grid](
        q, k, v, o, k_buffer, v_buffer, req_to_token, req_pool_indices, qo_indptr, prefix_lens,
        custom_mask if use_mask else prefix_lens, mask_indptr if use_mask else prefix_lens,
        positions if use_positions else prefix_lens, scaling, k_scale, v_scale, softcap, window,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), o.stride(0),
        o.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, V_DIM=v_dim, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_DV=triton.next_power_of_2(v_dim), USE_MASK=use_mask, USE_SOFTCAP=softcap > 0,
        USE_WINDOW=window > 0, USE_POSITIONS=use_positions, DOT_PRECISION=dot_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return o
