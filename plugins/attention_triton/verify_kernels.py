"""Split-KV attention for TARGET_VERIFY: a few draft tokens per request, read like decode.

A verify batch has the same small number of new tokens q_len in every request (the draft tree),
their K/V already in the pool. The extend kernel would give each query head a 128-row query block
of which q_len rows are real, with no split over the keys; here one program takes every
(token, query head) row of one KV-head group — q_len x group rows padded to BLOCK_H — over one
slice of the request's keys, as the decode kernel does for one token, and the decode merge kernel
combines the slices per (token, head).

Visibility: with a custom mask, request b's row-major [q_len, seq_len] block at mask_indptr[b]
(prefix columns included); without one, keys up to the token's own position (causal). Rows that
see no key of a slice write a log-sum-exp of -inf, which the merge weighs as zero; every row sees
at least its own key. The grid depends only on batch size, KV heads and splits (graph-safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import DecodeConfig, decode_config, dot_precision
from .decode_kernels import _decode_merge_kernel, _split_geometry
from .tile_ops import attend_tile, gather_kv_tile


@triton.jit
def _verify_split_kernel(
    Q, K_buf, V_buf, Req_to_token, Req_pool_indices, Seq_lens, Mask, Mask_indptr, Mid_o, Mid_lse,
    sm_scale, k_scale, v_scale, softcap, num_splits,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_req,
    stride_mt, stride_mh, stride_ms, stride_lt, stride_lh,
    Q_LEN: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    MIN_SPLIT: tl.constexpr, HAS_MASK: tl.constexpr, USE_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(Seq_lens + b).to(tl.int32)
    lo, split_len = _split_geometry(seq_len, num_splits, 0, BLOCK_N, MIN_SPLIT, False)
    start = lo + split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if end > start:
        rows = tl.arange(0, BLOCK_H)
        mask_r = rows < Q_LEN * GROUP
        token = rows // GROUP
        heads = kv_head * GROUP + rows % GROUP
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        offs_dv = tl.arange(0, BLOCK_DV)
        mask_dv = offs_dv < V_DIM
        q_rows = (b * Q_LEN + token).to(tl.int64)
        # q: [BLOCK_H, BLOCK_D], row r = (token r // GROUP, head r % GROUP of the group)
        q = tl.load(Q + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_r[:, None] & mask_d[None, :], other=0.0)
        q_pos = seq_len - Q_LEN + token  # each token's position, for the causal case
        mask_row = token.to(tl.int64) * 0
        if HAS_MASK:
            mask_row = tl.load(Mask_indptr + b).to(tl.int64) + token.to(tl.int64) * seq_len
        row_ptr = Req_to_token + tl.load(Req_pool_indices + b).to(tl.int64) * stride_req
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
        for start_n in range(start, end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            k_t, v = gather_kv_tile(row_ptr, K_buf, V_buf, kv_head, offs_n, mask_n, offs_d, mask_d, offs_dv,
                                    mask_dv, stride_kt, stride_kh, stride_vt, stride_vh)
            visible = mask_n[None, :] & mask_r[:, None]
            if HAS_MASK:
                allowed = tl.load(Mask + mask_row[:, None] + offs_n[None, :], mask=visible, other=0)
                visible = visible & (allowed != 0)
            else:
                visible = visible & (offs_n[None, :] <= q_pos[:, None])
            acc, l_i, m_i = attend_tile(q, k_t, v, visible, acc, l_i, m_i, sm_scale * k_scale, softcap,
                                        USE_SOFTCAP, True, DOT_PRECISION)
        seen = l_i > 0
        out = acc / tl.where(seen, l_i, 1.0)[:, None] * v_scale
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        mid = Mid_o + q_rows[:, None] * stride_mt + heads[:, None] * stride_mh + split * stride_ms + offs_dv[None, :]
        tl.store(mid, out, mask=mask_r[:, None] & mask_dv[None, :])
        tl.store(Mid_lse + q_rows * stride_lt + heads * stride_lh + split, lse, mask=mask_r)


def verify_rows_fit(tokens_per_request: int, num_heads: int, num_kv_heads: int, max_rows: int = 128) -> bool:
    """Whether one program can hold every (token, head) row of a KV-head group."""
    return tokens_per_request * (num_heads // num_kv_heads) <= max_rows


def verify_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    tokens_per_request: int,
    scaling: float,
    num_kv_splits: int,
    softcap: float = 0.0,
    custom_mask: torch.Tensor | None = None,
    mask_indptr: torch.Tensor | None = None,
    attn_logits: torch.Tensor | None = None,
    attn_lse: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of `tokens_per_request` new tokens per request over all their keys; writes `o`.

    q, o: [bs * tokens_per_request, num_heads, head_dim], request after request
    k_buffer / v_buffer: the pool ([num_slots + 1, num_kv_heads, dim]), the new tokens' K/V included
    req_to_token, req_pool_indices as for decode; seq_lens: [bs], keys per request (new ones included)
    custom_mask: flat bool, request b's [tokens_per_request, seq_len] block at mask_indptr[b]
      ([bs + 1] int64); None for causal
    attn_logits: [>= bs * tokens_per_request, num_heads, >= num_kv_splits, v_dim] fp32 and attn_lse:
      [>= bs * tokens_per_request, num_heads, >= num_kv_splits] fp32 (pass fixed ones for graphs)
    config: launch settings; None takes decode_config's for the K/V element size (up to 32 rows a group)
    k_scale, v_scale: what the stored keys and values are multiplied by (an FP8 pool's layer scales)
    """
    bs, q_len = seq_lens.shape[0], tokens_per_request
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, v_dim = k_buffer.shape[1], v_buffer.shape[2]
    if num_tokens != bs * q_len:
        raise ValueError(f"verify attention: expected {bs} x {q_len} query rows, got {num_tokens}")
    group = num_heads // num_kv_heads
    if not verify_rows_fit(q_len, num_heads, num_kv_heads):
        raise ValueError(f"verify attention: {q_len} tokens x {group} heads per KV head exceed 128 rows")
    if (custom_mask is None) != (mask_indptr is None):
        raise ValueError("verify attention: expected custom_mask and mask_indptr together")
    block_h = max(16, triton.next_power_of_2(q_len * group))
    # NOTE: the K/V element size picks the settings (decode_config) only up to 32 rows; beyond, the
    # 2-byte settings (FP8's fifth stage beside a wider accumulator and score tile is unmeasured).
    cfg = config or decode_config(head_dim, q.device, k_buffer.element_size() if block_h <= 32 else 2)
    if attn_logits is None:
        attn_logits = torch.empty((num_tokens, num_heads, num_kv_splits, v_dim), dtype=torch.float32, device=q.device)
    if attn_lse is None:
        attn_lse = torch.empty((num_tokens, num_heads, num_kv_splits), dtype=torch.float32, device=q.device)
    block_d, block_dv = triton.next_power_of_2(head_dim), triton.next_power_of_2(v_dim)
    has_mask = custom_mask is not None
    mask = custom_mask if has_mask else seq_lens  # any tensor: unread without a mask
    _verify_split_kernel[(bs, num_kv_heads, num_kv_splits)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, mask,
        mask_indptr if has_mask else seq_lens, attn_logits, attn_lse,
        scaling, k_scale, v_scale, softcap, num_kv_splits,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0),
        v_buffer.stride(1), req_to_token.stride(0), attn_logits.stride(0), attn_logits.stride(1),
        attn_logits.stride(2), attn_lse.stride(0), attn_lse.stride(1),
        Q_LEN=q_len, GROUP=group, HEAD_DIM=head_dim, V_DIM=v_dim,
        BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_DV=block_dv,
        BLOCK_N=cfg.block_n, MIN_SPLIT=cfg.min_split, HAS_MASK=has_mask, USE_SOFTCAP=softcap > 0,
        DOT_PRECISION=dot_precision(q.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    _decode_merge_kernel[(num_tokens, num_heads)](
        attn_logits, attn_lse, o, seq_lens, 0, num_kv_splits,
        attn_logits.stride(0), attn_logits.stride(1), attn_logits.stride(2), attn_lse.stride(0),
        attn_lse.stride(1), o.stride(0), o.stride(1),
        V_DIM=v_dim, BLOCK_DV=block_dv, BLOCK_S=triton.next_power_of_2(num_kv_splits),
        BLOCK_N=cfg.block_n, MIN_SPLIT=cfg.min_split, USE_WINDOW=False, TOKENS_PER_REQ=q_len,
        num_warps=cfg.merge_num_warps,
    )
    return o
