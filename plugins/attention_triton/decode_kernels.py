"""Split-KV decode attention over a page-size-1 KV pool.

Stage 1, grid (batch, num_kv_heads, num_kv_splits): one program takes every query head of one
KV-head group (padded to BLOCK_H >= 16 rows so the scores are one tl.dot) over one slice of the
request's keys, read through req_to_token, and writes the slice's normalised partial output and
its log-sum-exp. Stage 2, grid (batch, num_heads): merges the slices with log-sum-exp weights.
With at most FUSED_MERGE_MAX_SPLITS splits and a counters buffer, stage 2 runs inside stage 1
instead: the last program of a (request, KV head) to finish its slice (an atomic counter, re-armed
by that program) merges the group's few slices, which saves a launch a layer where the batch is
large enough to need few splits; with many splits one program merging them all would be slower.

The grid depends only on the batch size, the head counts and `num_kv_splits`, never on sequence
lengths, so both launches can be captured in a CUDA graph. Inside the kernel a request uses
min(num_kv_splits, ceil(kv_len / MIN_SPLIT)) slices of ceil(kv_len / slices) keys rounded up to
BLOCK_N; the programs of unused slices do nothing and stage 2 skips them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import DecodeConfig, decode_config, dot_precision, trigger_next
from .tile_ops import attend_tile, gather_kv_tile


@triton.jit
def _split_geometry(seq_len, num_splits, window, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr,
                    USE_WINDOW: tl.constexpr):
    """First visible key position and the length of one split (a multiple of BLOCK_N)."""
    lo = seq_len * 0
    if USE_WINDOW:
        # The query sits at seq_len - 1; keys at p > seq_len - 1 - window are visible.
        lo = tl.maximum(seq_len - window, 0)
    kv_len = seq_len - lo
    # NOTE: ceil divisions are spelled out; tl.cdiv is itself a jit function, which the interpreter
    # cannot call when triton was imported before TRITON_INTERPRET was set.
    used = tl.maximum(tl.minimum(num_splits, (kv_len + MIN_SPLIT - 1) // MIN_SPLIT), 1)
    split_len = ((kv_len + used - 1) // used + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    return lo, split_len


FUSED_MERGE_MAX_SPLITS = 4  # up to this many splits, the last program of a group merges them


@triton.jit
def _merge_group(Mid_o, Mid_lse, O, b, heads, mask_h, offs_dv, mask_dv, num_used,
                 stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
                 BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr, MAX_SPLITS: tl.constexpr):
    """O[b, heads] = the log-sum-exp-weighted mean of the first num_used slices' partials (stage 2
    for one KV-head group). The loads bypass L1 (.cg): other programs wrote those slices."""
    lse_rows = Mid_lse + b * stride_lb + heads * stride_lh
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    slot = tl.zeros([BLOCK_H], dtype=tl.int32)  # the slice index, per head row
    for s in tl.static_range(MAX_SPLITS):
        lse = tl.load(lse_rows + s, mask=mask_h & (slot + s < num_used), other=float("-inf"), cache_modifier=".cg")
        m = tl.maximum(m, lse)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    for s in tl.static_range(MAX_SPLITS):
        used = mask_h & (slot + s < num_used)
        lse = tl.load(lse_rows + s, mask=used, other=float("-inf"), cache_modifier=".cg")
        weight = tl.where(used, tl.exp2(lse - m), 0.0)
        part = tl.load(Mid_o + b * stride_mb + heads[:, None] * stride_mh + s * stride_ms + offs_dv[None, :],
                       mask=used[:, None] & mask_dv[None, :], other=0.0, cache_modifier=".cg")
        acc += part * weight[:, None]
        total += weight
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(O + b * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :], out.to(O.dtype.element_ty),
             mask=mask_h[:, None] & mask_dv[None, :])


@triton.jit
def _decode_split_kernel(
    Q, K_buf, V_buf, Req_to_token, Req_pool_indices, Seq_lens, Mid_o, Mid_lse, O, Counters,
    sm_scale, k_scale, v_scale, softcap, window, num_splits, num_kv_heads,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_req,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FUSE_MERGE: tl.constexpr, MAX_SPLITS: tl.constexpr, TRIGGER: tl.constexpr = False,
):
    if TRIGGER:  # NOTE: the output projection's kernel may launch now and wait for this one's writes
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(Seq_lens + b).to(tl.int32)
    lo, split_len = _split_geometry(seq_len, num_splits, window, BLOCK_N, MIN_SPLIT, USE_WINDOW)
    start = lo + split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if end > start:
        offs_h = tl.arange(0, BLOCK_H)
        mask_h = offs_h < GROUP
        heads = kv_head * GROUP + offs_h
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        offs_dv = tl.arange(0, BLOCK_DV)
        mask_dv = offs_dv < V_DIM
        # q: [BLOCK_H, BLOCK_D], the group's query heads (padding rows are zero)
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_h[:, None] & mask_d[None, :], other=0.0)
        row_ptr = Req_to_token + tl.load(Req_pool_indices + b).to(tl.int64) * stride_req
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
        for start_n in range(start, end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            # k_t: [BLOCK_D, BLOCK_N]; v: [BLOCK_N, BLOCK_DV]
            k_t, v = gather_kv_tile(row_ptr, K_buf, V_buf, kv_head, offs_n, mask_n, offs_d, mask_d, offs_dv,
                                    mask_dv, stride_kt, stride_kh, stride_vt, stride_vh)
            acc, l_i, m_i = attend_tile(q, k_t, v, mask_n[None, :], acc, l_i, m_i, sm_scale * k_scale, softcap,
                                        USE_SOFTCAP, True, DOT_PRECISION)
        # Every row saw at least one key, so l_i > 0.
        mid = Mid_o + b * stride_mb + heads[:, None] * stride_mh + split * stride_ms + offs_dv[None, :]
        tl.store(mid, acc / l_i[:, None] * v_scale, mask=mask_h[:, None] & mask_dv[None, :])
        tl.store(Mid_lse + b * stride_lb + heads * stride_lh + split, m_i + tl.log2(l_i), mask=mask_h)
        if FUSE_MERGE:
            # Slices with keys: lo + s * split_len < seq_len, i.e. the programs that reach this point.
            num_used = tl.minimum((seq_len - lo + split_len - 1) // split_len, num_splits)
            counter = Counters + b * num_kv_heads + kv_head
            tl.debug_barrier()  # NOTE: every thread's stores happen before the release below
            if tl.atomic_add(counter, 1, sem="acq_rel") == num_used - 1:  # the last slice to finish
                _merge_group(Mid_o, Mid_lse, O, b, heads, mask_h, offs_dv, mask_dv, num_used,
                             stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
                             BLOCK_H, BLOCK_DV, MAX_SPLITS)
                tl.atomic_xchg(counter, 0)  # re-armed for the next launch (and graph replay)


@triton.jit
def _decode_merge_kernel(
    Mid_o, Mid_lse, O, Seq_lens, window, num_splits,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
    V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
    MIN_SPLIT: tl.constexpr, USE_WINDOW: tl.constexpr, TOKENS_PER_REQ: tl.constexpr = 1,
):
    # b: the query row (TOKENS_PER_REQ rows per request, which share the request's split geometry)
    b = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(Seq_lens + b // TOKENS_PER_REQ).to(tl.int32)
    lo, split_len = _split_geometry(seq_len, num_splits, window, BLOCK_N, MIN_SPLIT, USE_WINDOW)
    offs_s = tl.arange(0, BLOCK_S)
    used = (offs_s < num_splits) & (lo + offs_s * split_len < seq_len)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < V_DIM
    lse = tl.load(Mid_lse + b * stride_lb + head * stride_lh + offs_s, mask=used, other=float("-inf"))
    weights = tl.exp2(lse - tl.max(lse, 0))
    # part: [BLOCK_S, BLOCK_DV], each split's normalised output
    part = tl.load(Mid_o + b * stride_mb + head * stride_mh + offs_s[:, None] * stride_ms + offs_dv[None, :],
                   mask=used[:, None] & mask_dv[None, :], other=0.0)
    out = tl.sum(part * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(O + b * stride_ob + head * stride_oh + offs_dv, out.to(O.dtype.element_ty), mask=mask_dv)


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scaling: float,
    num_kv_splits: int,
    softcap: float = 0.0,
    window: int = 0,
    attn_logits: torch.Tensor | None = None,
    attn_lse: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
    merge_counters: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of one new token per request over all its cached keys; writes and returns `o`.

    q: [bs, num_heads, head_dim]; o: [bs, num_heads, v_dim] (q's dtype)
    k_buffer: [num_slots + 1, num_kv_heads, head_dim]; v_buffer: [num_slots + 1, num_kv_heads, v_dim]
    req_to_token: [rows, max_context_len] int32, the slot of each position of each request
    req_pool_indices: [bs] int, the request's row; seq_lens: [bs] int, keys per request (the new
      token included, its K/V already in the pool)
    softcap: 0 for none; window: keys at p > seq_len - 1 - window are visible, 0 for no window
    attn_logits: [>= bs, num_heads, >= num_kv_splits, v_dim] fp32 and attn_lse: [>= bs, num_heads,
      >= num_kv_splits] fp32, scratch buffers (allocated here when None; pass fixed ones for graphs)
    merge_counters: [>= bs * num_kv_heads] int32, zero, caller-owned (every launch leaves it zero):
      with at most FUSED_MERGE_MAX_SPLITS splits the merge runs inside the first kernel (one launch)
    config: launch settings; None takes decode_config(head_dim, device, the K/V element size), so an
      FP8 pool gets its own (more keys a step)
    k_scale, v_scale: what the stored keys and values are multiplied by (an FP8 pool's layer scales)
    """
    bs, num_heads, head_dim = q.shape
    num_kv_heads, v_dim = k_buffer.shape[1], v_buffer.shape[2]
    assert q.stride(2) == k_buffer.stride(2) == v_buffer.stride(2) == 1, "head_dim must be contiguous"
    cfg = config or decode_config(head_dim, q.device, k_buffer.element_size())
    if attn_logits is None:
        attn_logits = torch.empty((bs, num_heads, num_kv_splits, v_dim), dtype=torch.float32, device=q.device)
    if attn_lse is None:
        attn_lse = torch.empty((bs, num_heads, num_kv_splits), dtype=torch.float32, device=q.device)
    assert attn_logits.shape[2] >= num_kv_splits and attn_lse.shape[2] >= num_kv_splits, "scratch too small"
    group = num_heads // num_kv_heads
    block_d, block_dv = triton.next_power_of_2(head_dim), triton.next_power_of_2(v_dim)
    use_window = window > 0
    fuse_merge = merge_counters is not None and num_kv_splits <= FUSED_MERGE_MAX_SPLITS
    if fuse_merge and merge_counters.numel() < bs * num_kv_heads:
        raise ValueError(f"decode_attention: merge_counters holds {merge_counters.numel()} counters; expected at "
                         f"least batch {bs} x {num_kv_heads} KV heads")
    _decode_split_kernel[(bs, num_kv_heads, num_kv_splits)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, attn_logits, attn_lse, o,
        merge_counters if fuse_merge else attn_lse, scaling, k_scale, v_scale, softcap, window, num_kv_splits,
        num_kv_heads,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0),
        v_buffer.stride(1), req_to_token.stride(0), attn_logits.stride(0), attn_logits.stride(1),
        attn_logits.stride(2), attn_lse.stride(0), attn_lse.stride(1), o.stride(0), o.stride(1),
        GROUP=group, HEAD_DIM=head_dim, V_DIM=v_dim, BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d, BLOCK_DV=block_dv, BLOCK_N=cfg.block_n, MIN_SPLIT=cfg.min_split,
        USE_SOFTCAP=softcap > 0, USE_WINDOW=use_window, DOT_PRECISION=dot_precision(q.dtype),
        FUSE_MERGE=fuse_merge, MAX_SPLITS=FUSED_MERGE_MAX_SPLITS, TRIGGER=fuse_merge and trigger_next(q.device),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if fuse_merge:
        return o
    _decode_merge_kernel[(bs, num_heads)](
        attn_logits, attn_lse, o, seq_lens, window, num_kv_splits,
        attn_logits.stride(0), attn_logits.stride(1), attn_logits.stride(2), attn_lse.stride(0),
        attn_lse.stride(1), o.stride(0), o.stride(1),
        V_DIM=v_dim, BLOCK_DV=block_dv, BLOCK_S=triton.next_power_of_2(num_kv_splits),
        BLOCK_N=cfg.block_n, MIN_SPLIT=cfg.min_split, USE_WINDOW=use_window,
        num_warps=cfg.merge_num_warps,
    )
    return o
