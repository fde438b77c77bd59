"""Native PyTorch implementations of the custom ops: the reference every faster plugin must match.

Each function here fixes the signature of its op; a plugin's `CustomOpImpl.fn` for the same op
takes the same arguments and returns the same shapes and dtypes.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32 and returned in x's dtype.

    x: [..., hidden]; weight: [hidden].
    """
    x32 = x.float()
    variance = x32.pow(2).mean(dim=-1, keepdim=True)
    return (x32 * torch.rsqrt(variance + eps) * weight.float()).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual_out = x + residual; y = rms_norm(residual_out). Returns (y, residual_out).

    x, residual: [..., hidden] of the same dtype; weight: [hidden].
    """
    residual_out = x + residual
    return rms_norm(residual_out, weight, eps), residual_out


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d = x.shape[-1] // 2
    return x[..., :d], x[..., d:]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * d] -> silu(x[..., :d]) * x[..., d:]: [..., d]."""
    gate, up = _halves(x)
    return F.silu(gate) * up


def gelu_and_mul(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """x: [..., 2 * d] -> gelu(x[..., :d]) * x[..., d:]: [..., d]; approximate is "none" or "tanh"."""
    gate, up = _halves(x)
    return F.gelu(gate, approximate=approximate) * up


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """Elementwise GELU, exact ("none") or the tanh approximation ("tanh")."""
    return F.gelu(x, approximate=approximate)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 * x)."""
    return x * torch.sigmoid(1.702 * x)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """Rotate the first rotary_dim dims of x: [T, H, D]; cos, sin: [T, 1, rotary_dim // 2] fp32."""
    rotary_dim = cos.shape[-1] * 2
    rot, rest = x[..., :rotary_dim].float(), x[..., rotary_dim:]
    if is_neox:  # pairs are (i, i + rotary_dim / 2)
        x1, x2 = _halves(rot)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:  # GPT-J style: pairs are (2i, 2i + 1)
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((out.to(x.dtype), rest), dim=-1)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply rotary position embeddings to q and k; returns new tensors (q, k).

    positions: [T] int; q: [T, num_heads, head_dim]; k: [T, num_kv_heads, head_dim];
    cos_sin_cache: [max_position, rotary_dim] fp32, cos in the first half of the last dim and sin
    in the second. Only the first rotary_dim (<= head_dim) dims of each head are rotated.
    """
    cos_sin = cos_sin_cache.index_select(0, positions.long())  # [T, rotary_dim]
    cos, sin = _halves(cos_sin.unsqueeze(-2))  # [T, 1, rotary_dim // 2]
    return _rotate(q, cos, sin, is_neox), _rotate(k, cos, sin, is_neox)


def rotary_kv_write(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_embedding` of q and k, then the rotated k and v written into the KV cache at `loc`.

    positions, q, k, cos_sin_cache, is_neox: as `rotary_embedding`; v: [T, num_kv_heads, head_dim];
    k_cache, v_cache: [num_slots, num_kv_heads, head_dim] (one layer of the pool, any float dtype);
    loc: [T] int slot of each token. Writes k_cache[loc] and v_cache[loc] in the cache's dtype (as
    `TokenToKVPool.set_kv_buffer` does) and returns new tensors (q_rot, k_rot) in q's and k's dtype;
    q, k and v are left unchanged. An FP8 cache is refused: it needs the layer's scales, which this
    op does not take, so a backend over an FP8 pool declines `fuses_rotary_kv_write`.
    """
    if torch.float8_e4m3fn in (k_cache.dtype, v_cache.dtype):
        raise ValueError("rotary_kv_write: expected a KV cache of a float dtype other than float8_e4m3fn, got "
                         f"{k_cache.dtype}; an FP8 pool is written by TokenToKVPool.set_kv_buffer (with its scales)")
    q_rot, k_rot = rotary_embedding(positions, q, k, cos_sin_cache, is_neox)
    k_cache[loc] = k_rot.to(k_cache.dtype)
    v_cache[loc] = v.to(v_cache.dtype)
    return q_rot, k_rot


def greedy_sample(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy token of each row and its log-probability: (tokens [bs] int64, logprobs [bs]).

    logits: [bs, vocab] fp32. tokens[i] is torch.argmax of row i (the first maximal index; a NaN
    counts as maximal); logprobs[i] is log_softmax(row i)[tokens[i]], in the logits' dtype. A faster
    implementation may return both as views of one buffer: tokens first, logprobs from the first
    16-byte boundary after them (LaunchedStep.launch then copies them to the host at once).
    """
    tokens = logits.argmax(dim=-1)
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    return tokens, logprobs


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A mixture-of-experts router: (topk_weights [T, k] fp32, topk_ids [T, k] int32).

    router_logits: [T, E], any float dtype; 1 <= top_k <= E (the caller checks: `backplane.moe.route`).
    topk_weights[t] are the k largest of softmax(router_logits[t]) computed in fp32, in decreasing
    order (ties to the lower expert id, as torch.topk), divided by their sum when `renormalize`;
    topk_ids[t] are their experts.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)  # [T, E]
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)  # [T, k], sorted
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids.to(torch.int32)


NATIVE_OPS: dict[str, Callable] = {
    "rms_norm": rms_norm,
    "fused_add_rms_norm": fused_add_rms_norm,
    "silu_and_mul": silu_and_mul,
    "gelu_and_mul": gelu_and_mul,
    "gelu": gelu,
    "quick_gelu": quick_gelu,
    "rotary_embedding": rotary_embedding,
    "rotary_kv_write": rotary_kv_write,
    "greedy_sample": greedy_sample,
    "moe_route": moe_route,
}
