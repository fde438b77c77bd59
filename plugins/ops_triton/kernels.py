"""Triton kernels of the fused custom ops, and their launchers.

Every launcher allocates its outputs with torch (which a CUDA graph's capture takes from the graph
pool) and launches with a grid computed from shapes only: no host synchronization, so each one may
be captured. The arithmetic follows `backplane.ops.native` step by step, including where native
rounds to the activation dtype, so results match it to a few ulps (bit for bit where noted).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# rms_norm / fused_add_rms_norm hold a whole row in one block.
MAX_NORM_HIDDEN = 65536
_ACT_BLOCK = 1024
GREEDY_BLOCK = 8192  # greedy_sample: a row goes through one program, this many logits per step
MAX_ROUTE_EXPERTS = 1024  # moe_route holds a row of router logits in one block


@triton.jit
def _let_next_launch(TRIGGER: tl.constexpr):
    # NOTE: the norms and the activation feed a linear layer, whose kernel may be launched with
    # programmatic dependent launch (quant_fp8's GEMMs are): letting it launch now lets its programs
    # read their weights while this kernel runs; it still waits for this kernel's writes. A no-op
    # for a next kernel launched without it.
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, y_ptr, residual_out_ptr,
                     x_stride, residual_stride, hidden, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, TRIGGER: tl.constexpr):
    # One program per row. x, residual: [rows, hidden] (unit last stride); y, residual_out contiguous.
    _let_next_launch(TRIGGER)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        # NOTE: native adds in the activation dtype; the fp32 sum rounded once equals it exactly.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * hidden + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, axis=0) / hidden
    rstd = tl.rsqrt(variance + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = x32 * rstd * w
    tl.store(y_ptr + row * hidden + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, d, BLOCK: tl.constexpr, TRIGGER: tl.constexpr):
    # Grid (rows, cdiv(d, BLOCK)). x: [rows, 2 * d] (unit last stride); out: [rows, d] contiguous.
    _let_next_launch(TRIGGER)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + d + cols, mask=mask, other=0.0)
    # NOTE: native rounds silu(gate) to the activation dtype before the product; so does this.
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * d + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, cache_ptr, src_stride, cos, sin, num_heads, head_dim, rot_half,
                  WRITE_CACHE: tl.constexpr, IS_NEOX: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    # One token's heads: src [num_heads, head_dim] rows of stride src_stride; dst, cache contiguous
    # [num_heads, head_dim] rows (cache, in its own dtype, only when WRITE_CACHE).
    heads = tl.arange(0, BLOCK_H)[:, None]
    pairs = tl.arange(0, BLOCK_P)[None, :]
    pair_mask = (heads < num_heads) & (pairs < rot_half)
    if IS_NEOX:  # pairs (i, i + rotary_dim / 2)
        off1 = pairs
        off2 = pairs + rot_half
    else:  # GPT-J: pairs (2i, 2i + 1)
        off1 = 2 * pairs
        off2 = 2 * pairs + 1
    x1 = tl.load(src_ptr + heads * src_stride + off1, mask=pair_mask, other=0.0)
    x2 = tl.load(src_ptr + heads * src_stride + off2, mask=pair_mask, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    # NOTE: native rounds the rotated values to the activation dtype, then casts to the cache's.
    o1 = (x1f * cos - x2f * sin).to(x1.dtype)
    o2 = (x2f * cos + x1f * sin).to(x1.dtype)
    tl.store(dst_ptr + heads * head_dim + off1, o1, mask=pair_mask)
    tl.store(dst_ptr + heads * head_dim + off2, o2, mask=pair_mask)
    # dims past rotary_dim pass through unchanged
    dims = tl.arange(0, BLOCK_D)[None, :]
    rest_mask = (heads < num_heads) & (dims >= 2 * rot_half) & (dims < head_dim)
    rest = tl.load(src_ptr + heads * src_stride + dims, mask=rest_mask, other=0.0)
    tl.store(dst_ptr + heads * head_dim + dims, rest, mask=rest_mask)
    if WRITE_CACHE:
        cache_dtype = cache_ptr.dtype.element_ty
        tl.store(cache_ptr + heads * head_dim + off1, o1.to(cache_dtype), mask=pair_mask)
        tl.store(cache_ptr + heads * head_dim + off2, o2.to(cache_dtype), mask=pair_mask)
        tl.store(cache_ptr + heads * head_dim + dims, rest.to(cache_dtype), mask=rest_mask)


@triton.jit
def _rotary_kv_write_kernel(positions_ptr, q_ptr, k_ptr, v_ptr, cos_sin_ptr, q_out_ptr, k_out_ptr,
                            k_cache_ptr, v_cache_ptr, loc_ptr,
                            q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
                            cos_sin_stride, num_heads, num_kv_heads, head_dim, rot_half,
                            WRITE_CACHE: tl.constexpr, IS_NEOX: tl.constexpr, BLOCK_HQ: tl.constexpr,
                            BLOCK_HK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program per token. q: [T, Hq, D]; k, v: [T, Hk, D] (unit last stride); q_out, k_out
    # contiguous; k_cache, v_cache: [slots, Hk, D] contiguous; cos_sin: [max_pos, 2 * rot_half] fp32.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    pairs = tl.arange(0, BLOCK_P)[None, :]
    cs_mask = pairs < rot_half
    cos = tl.load(cos_sin_ptr + pos * cos_sin_stride + pairs, mask=cs_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * cos_sin_stride + rot_half + pairs, mask=cs_mask, other=0.0)
    kv_row = num_kv_heads * head_dim
    if WRITE_CACHE:
        slot = tl.load(loc_ptr + t).to(tl.int64)
    else:
        slot = t
    _rotate_heads(q_ptr + t * q_stride_t, q_out_ptr + t * num_heads * head_dim, q_out_ptr, q_stride_h, cos, sin,
                  num_heads, head_dim, rot_half, False, IS_NEOX, BLOCK_HQ, BLOCK_P, BLOCK_D)
    _rotate_heads(k_ptr + t * k_stride_t, k_out_ptr + t * kv_row, k_cache_ptr + slot * kv_row, k_stride_h, cos, sin,
                  num_kv_heads, head_dim, rot_half, WRITE_CACHE, IS_NEOX, BLOCK_HK, BLOCK_P, BLOCK_D)
    if WRITE_CACHE:
        heads = tl.arange(0, BLOCK_HK)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < num_kv_heads) & (dims < head_dim)
        v = tl.load(v_ptr + t * v_stride_t + heads * v_stride_h + dims, mask=mask, other=0.0)
        tl.store(v_cache_ptr + slot * kv_row + heads * head_dim + dims, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _greedy_sample_kernel(logits_ptr, tokens_ptr, logprobs_ptr, row_stride, vocab, BLOCK: tl.constexpr):
    # One program per row, one pass over it. logits: [bs, vocab] fp32 (unit last stride); tokens [bs]
    # int64, logprobs [bs] fp32. Lane j sees indices j, j + BLOCK, ... in order and keeps the largest
    # value it saw (first index of it: only a larger value replaces it) and the sum of exp(x - largest).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        idx = start + cols
        x = tl.load(logits_ptr + row * row_stride + idx, mask=idx < vocab, other=float("-inf"))
        # NOTE: a NaN counts as larger than any number, as in torch.argmax
        take = (x > best) | ((x != x) & (best == best))
        new_best = tl.where(take, x, best)
        # NOTE: while a lane has seen only -inf its sum stays 0 (exp(-inf - -inf) would be NaN)
        seen = new_best != float("-inf")
        shift = tl.where(seen, new_best, 0.0)
        total = tl.where(seen, total * tl.exp(best - shift) + tl.exp(x - shift), 0.0)
        best_idx = tl.where(take, idx, best_idx)
        best = new_best
    is_nan = best != best
    has_nan = tl.max(is_nan.to(tl.int32), axis=0) > 0
    top = tl.max(tl.where(is_nan, float("-inf"), best), axis=0)
    # the first maximal index: the smallest among the lanes holding the row's maximum (or a NaN)
    holds = tl.where(has_nan, is_nan, best == top)
    token = tl.min(tl.where(holds, best_idx, vocab), axis=0)
    all_masked = top == float("-inf")
    row_sum = tl.sum(tl.where(best == float("-inf"), 0.0, total * tl.exp(best - tl.where(all_masked, 0.0, top))), axis=0)
    # log_softmax at the argmax is -log(sum of exp(x - top)); NaN for a row of -inf, as torch's (a NaN
    # lane's sum is NaN already)
    logprob = tl.where(all_masked, float("nan"), -tl.log(tl.where(all_masked, 1.0, row_sum)))
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(logprobs_ptr + row, logprob)


@triton.jit
def _moe_route_kernel(logits_ptr, weights_ptr, ids_ptr, row_stride, num_experts, top_k,
                      RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    # One program per token. logits: [T, E] any float dtype (unit last stride); weights [T, k] fp32,
    # ids [T, k] int32, contiguous. softmax in fp32, then k rounds of argmax over the probabilities.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    valid = cols < num_experts
    x = tl.load(logits_ptr + row * row_stride + cols, mask=valid, other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    probs = e / tl.sum(e, axis=0)
    # NOTE: a chosen expert becomes -1 and a padding lane -2, below any probability (an underflowed
    # 0 included), so each round's maximum is the next of torch.topk's order
    probs = tl.where(valid, probs, -2.0)
    slots = tl.arange(0, BLOCK_K)
    top_weights = tl.zeros([BLOCK_K], tl.float32)
    top_ids = tl.zeros([BLOCK_K], tl.int32)
    for i in range(top_k):
        weight = tl.max(probs, axis=0)
        # the lower id among equal probabilities; NOTE: a NaN counts as a maximum too, so a row with a NaN
        # logit (all probabilities NaN) still gets ids of real experts
        best = tl.min(tl.where((probs == weight) | (probs != probs), cols, BLOCK_E), axis=0)
        top_weights = tl.where(slots == i, weight, top_weights)
        top_ids = tl.where(slots == i, best, top_ids)
        probs = tl.where(cols == best, -1.0, probs)
    if RENORMALIZE:
        top_weights = top_weights / tl.sum(tl.where(slots < top_k, top_weights, 0.0), axis=0)
    out = slots < top_k
    tl.store(weights_ptr + row * top_k + slots, top_weights, mask=out)
    tl.store(ids_ptr + row * top_k + slots, top_ids, mask=out)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x: [..., hidden] -> [rows, hidden] with a unit last stride (a view when possible)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _norm_launch(hidden: int, device: torch.device) -> dict:
    """Meta-parameters of the norm kernels: one block per row, more warps for wider rows."""
    block = triton.next_power_of_2(hidden)
    return dict(BLOCK=block, num_warps=max(1, min(16, block // 256)), TRIGGER=trigger_next(device))


def trigger_next(device: torch.device) -> bool:
    """Whether kernels on `device` let the next kernel launch early (_let_next_launch): a CUDA GPU of
    compute capability 9.0 or newer, compiled (not the interpreter), with Triton's griddepcontrol."""
    return device.type == "cuda" and _trigger_capable(device.index if device.index is not None else
                                                      torch.cuda.current_device())


@functools.cache
def _trigger_capable(index: int) -> bool:
    return (os.environ.get("TRITON_INTERPRET") != "1" and torch.version.cuda is not None  # NOTE: not ROCm's 9.x
            and torch.cuda.get_device_capability(index) >= (9, 0) and hasattr(tl.extra.cuda, "gdc_launch_dependents"))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., hidden]; weight: [hidden] -> y: [..., hidden] in x's dtype (a new tensor)."""
    rows = _rows(x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, rows, weight, y, y, rows.stride(0), rows.stride(0), rows.shape[1],
                                           eps, HAS_RESIDUAL=False, **_norm_launch(rows.shape[1], x.device))
    return y


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [..., hidden] -> (y, residual_out), both new tensors; the inputs are left unchanged."""
    rows, res_rows = _rows(x), _rows(residual)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, res_rows, weight, y, residual_out, rows.stride(0), res_rows.stride(0),
                                           rows.shape[1], eps, HAS_RESIDUAL=True,
                                           **_norm_launch(rows.shape[1], x.device))
    return y, residual_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * d] -> silu(x[..., :d]) * x[..., d:]: [..., d] (a new tensor)."""
    rows = _rows(x)
    d = rows.shape[1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    if rows.shape[0] and d:
        grid = (rows.shape[0], triton.cdiv(d, _ACT_BLOCK))
        _silu_and_mul_kernel[grid](rows, out, rows.stride(0), d, BLOCK=_ACT_BLOCK, TRIGGER=trigger_next(x.device))
    return out


def greedy_sample(logits: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
    """Write the argmax of each row of logits [bs, vocab] fp32 (unit last stride) into tokens [bs]
    int64 and its log-softmax into logprobs [bs] fp32 (the caller's buffers)."""
    bs, vocab = logits.shape
    block = min(GREEDY_BLOCK, triton.next_power_of_2(vocab))
    if bs:
        _greedy_sample_kernel[(bs,)](logits, tokens, logprobs, logits.stride(0), vocab, BLOCK=block,
                                     num_warps=max(1, min(16, block // 512)))


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] (E <= MAX_ROUTE_EXPERTS, unit last stride) -> (topk_weights [T, k] fp32,
    topk_ids [T, k] int32), new tensors: `backplane.ops.native.moe_route` in one launch (none for T = 0)."""
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=router_logits.device)
    if num_tokens:
        block = triton.next_power_of_2(num_experts)
        _moe_route_kernel[(num_tokens,)](router_logits, weights, ids, router_logits.stride(0), num_experts, top_k,
                                         RENORMALIZE=renormalize, BLOCK_E=block,
                                         BLOCK_K=triton.next_power_of_2(top_k), num_warps=1 if block <= 256 else 4)
    return weights, ids


def _heads(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def rotary_kv_write(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                    cos_sin_cache: torch.Tensor, is_neox: bool, k_cache: torch.Tensor | None,
                    v_cache: torch.Tensor | None, loc: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q, k (the signature of `backplane.ops.native.rotary_kv_write`); with v and the caches
    given, also write the rotated k and v at slots `loc`. Returns new (q_rot, k_rot)."""
    q, k = _heads(q), _heads(k)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    rot_half = cos_sin_cache.shape[-1] // 2
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    write = k_cache is not None
    v = _heads(v) if write else k
    _rotary_kv_write_kernel[(num_tokens,)](
        positions, q, k, v, cos_sin_cache, q_out, k_out,
        k_cache if write else k_out, v_cache if write else k_out, loc if write else positions,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin_cache.stride(0), num_heads, num_kv_heads, head_dim, rot_half,
        WRITE_CACHE=write, IS_NEOX=is_neox, BLOCK_HQ=triton.next_power_of_2(num_heads),
        BLOCK_HK=triton.next_power_of_2(num_kv_heads), BLOCK_P=triton.next_power_of_2(max(rot_half, 1)),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return q_out, k_out
