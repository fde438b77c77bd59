"""The Triton custom ops, with the signatures of `backplane.ops.native`, safe under torch.compile.

Each op is a torch.library custom op (`torch.ops.ops_triton.*`) with a fake implementation, so
inside torch.compile Dynamo records one opaque call and Inductor never looks into the kernel. In
eager mode (and inside a CUDA graph's capture) the table's function launches the kernel directly,
without the custom op's dispatch. Inputs the kernels do not take (a CPU tensor without
TRITON_INTERPRET=1, fp64, a norm row wider than one block, a non-contiguous KV cache) go to the
native implementation. triton is imported on the first launch, never when this module loads.

NOTE: no `from __future__ import annotations` here: torch.library reads the annotations to infer
each op's schema.
"""

import os

import torch

from backplane.ops import native

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_NORM_HIDDEN = 65536  # rms_norm holds a row in one block
MAX_ROUTE_EXPERTS = 1024  # moe_route holds a row of router logits in one block


def _runs(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors: CUDA ones (CPU ones under the interpreter), one
    float dtype among fp32/fp16/bf16."""
    first = tensors[0]
    return (
        (first.is_cuda or (_INTERPRETED and first.device.type == "cpu"))
        and first.dtype in _DTYPES
        and all(t.device == first.device and t.dtype == first.dtype for t in tensors)
    )


def _kernels():
    from backplane.plugins.ops_triton import kernels

    return kernels


# -- the torch.library ops (what torch.compile sees) ----------------------------------------------


@torch.library.custom_op("ops_triton::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _kernels().rms_norm(x, weight, eps)


@rms_norm_op.register_fake
def _rms_norm_fake(x, weight, eps):
    return x.new_empty(x.shape)


@torch.library.custom_op("ops_triton::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _kernels().fused_add_rms_norm(x, residual, weight, eps)


@fused_add_rms_norm_op.register_fake
def _fused_add_rms_norm_fake(x, residual, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape)


@torch.library.custom_op("ops_triton::silu_and_mul", mutates_args=())
def silu_and_mul_op(x: torch.Tensor) -> torch.Tensor:
    return _kernels().silu_and_mul(x)


@silu_and_mul_op.register_fake
def _silu_and_mul_fake(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@torch.library.custom_op("ops_triton::rotary_embedding", mutates_args=())
def rotary_embedding_op(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                        is_neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _kernels().rotary_kv_write(positions, q, k, None, cos_sin_cache, is_neox, None, None, None)


@rotary_embedding_op.register_fake
def _rotary_embedding_fake(positions, q, k, cos_sin_cache, is_neox):
    return q.new_empty(q.shape), k.new_empty(k.shape)


@torch.library.custom_op("ops_triton::rotary_kv_write", mutates_args=("k_cache", "v_cache"))
def rotary_kv_write_op(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       cos_sin_cache: torch.Tensor, is_neox: bool, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _kernels().rotary_kv_write(positions, q, k, v, cos_sin_cache, is_neox, k_cache, v_cache, loc)


@rotary_kv_write_op.register_fake
def _rotary_kv_write_fake(positions, q, k, v, cos_sin_cache, is_neox, k_cache, v_cache, loc):
    return q.new_empty(q.shape), k.new_empty(k.shape)


@torch.library.custom_op("ops_triton::greedy_sample", mutates_args=())
def greedy_sample_op(logits: torch.Tensor) -> torch.Tensor:
    # NOTE: a custom op's results may not alias each other: it returns the packed buffer, split outside
    return _greedy_sample_packed(logits)[0]


@greedy_sample_op.register_fake
def _greedy_sample_fake(logits):
    return logits.new_empty(_packed_bytes(logits.shape[0]), dtype=torch.uint8)


@torch.library.custom_op("ops_triton::moe_route", mutates_args=())
def moe_route_op(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _kernels().moe_route(router_logits, top_k, renormalize)


@moe_route_op.register_fake
def _moe_route_fake(router_logits, top_k, renormalize):
    num_tokens = router_logits.shape[0]
    return (router_logits.new_empty((num_tokens, top_k), dtype=torch.float32),
            router_logits.new_empty((num_tokens, top_k), dtype=torch.int32))


# -- the table's functions (CustomOpImpl.fn) --------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight in fp32, returned in x's dtype. x: [..., hidden]."""
    if not _runs(x) or not _runs(weight) or weight.device != x.device or x.shape[-1] > MAX_NORM_HIDDEN:
        return native.rms_norm(x, weight, eps)
    if torch.compiler.is_compiling():
        return rms_norm_op(x, weight, eps)
    return _kernels().rms_norm(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), both new tensors; x and residual are left unchanged,
    as native leaves them. The sum is rounded to x's dtype before the norm, as native does."""
    if (not _runs(x, residual) or not _runs(weight) or weight.device != x.device or x.shape[-1] > MAX_NORM_HIDDEN
            or x.shape != residual.shape):
        return native.fused_add_rms_norm(x, residual, weight, eps)
    if torch.compiler.is_compiling():
        return fused_add_rms_norm_op(x, residual, weight, eps)
    return _kernels().fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * d] -> silu(x[..., :d]) * x[..., d:]: [..., d]."""
    if not _runs(x):
        return native.silu_and_mul(x)
    if torch.compiler.is_compiling():
        return silu_and_mul_op(x)
    return _kernels().silu_and_mul(x)


def _rotary_runs(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor) -> bool:
    return (_runs(q, k) and positions.device == q.device and cos_sin_cache.device == q.device
            and cos_sin_cache.dtype == torch.float32 and cos_sin_cache.stride(-1) == 1)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                     is_neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first rotary_dim dims of every head of q: [T, Hq, D] and k: [T, Hk, D]; new (q, k)."""
    if not _rotary_runs(positions, q, k, cos_sin_cache):
        return native.rotary_embedding(positions, q, k, cos_sin_cache, is_neox)
    if torch.compiler.is_compiling():
        return rotary_embedding_op(positions, q, k, cos_sin_cache, is_neox)
    return _kernels().rotary_kv_write(positions, q, k, None, cos_sin_cache, is_neox, None, None, None)


def rotary_kv_write(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    cos_sin_cache: torch.Tensor, is_neox: bool, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary of q and k, and the rotated k and v written at slots `loc` of k_cache / v_cache, in one
    launch. Shapes as `backplane.ops.native.rotary_kv_write`; returns new (q_rot, k_rot)."""
    fits = (_rotary_runs(positions, q, k, cos_sin_cache) and v.device == q.device and loc.device == q.device
            and k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.device == q.device
            and k_cache.shape[1:] == k.shape[1:] and v_cache.shape[1:] == v.shape[1:])
    if not fits:
        return native.rotary_kv_write(positions, q, k, v, cos_sin_cache, is_neox, k_cache, v_cache, loc)
    if torch.compiler.is_compiling():
        return rotary_kv_write_op(positions, q, k, v, cos_sin_cache, is_neox, k_cache, v_cache, loc)
    return _kernels().rotary_kv_write(positions, q, k, v, cos_sin_cache, is_neox, k_cache, v_cache, loc)


def _logprobs_offset(bs: int) -> int:
    # NOTE: 16-byte aligned, the layout LaunchedStep.launch copies at once; the kernel's pointer to
    # them is then aligned for every bs (one Triton specialization)
    return -(-8 * bs // 16) * 16


def _packed_bytes(bs: int) -> int:
    return _logprobs_offset(bs) + 4 * bs


def _unpack(packed: torch.Tensor, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """packed uint8 [_packed_bytes(bs)] -> (tokens [bs] int64, logprobs [bs] fp32), views of it."""
    return packed[:8 * bs].view(torch.int64), packed[_logprobs_offset(bs):].view(torch.float32)


def _greedy_sample_packed(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One launch: (packed buffer, tokens, logprobs), the last two views of the first."""
    packed = torch.empty(_packed_bytes(logits.shape[0]), dtype=torch.uint8, device=logits.device)
    tokens, logprobs = _unpack(packed, logits.shape[0])
    _kernels().greedy_sample(logits, tokens, logprobs)
    return packed, tokens, logprobs


def greedy_sample(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [bs, vocab] fp32 -> (argmax [bs] int64, its log-softmax [bs] fp32), in one kernel.

    Both are views of one contiguous buffer, tokens first and logprobs from the next 16-byte
    boundary, so LaunchedStep.launch copies them to the host at once. Ties and NaN as
    torch.argmax. Other dtypes, an empty vocab or a strided row go to native.
    """
    if (not _runs(logits) or logits.dtype != torch.float32 or logits.dim() != 2 or logits.shape[1] == 0
            or logits.stride(-1) != 1):
        return native.greedy_sample(logits)
    if torch.compiler.is_compiling():
        return _unpack(greedy_sample_op(logits), logits.shape[0])
    return _greedy_sample_packed(logits)[1:]


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights [T, k] fp32, topk_ids [T, k] int32) in one kernel: softmax
    in fp32, the k largest (ties to the lower expert id, as torch.topk), renormalised when asked.
    More than MAX_ROUTE_EXPERTS experts, a strided row or top_k outside 1..E go to native."""
    if (not _runs(router_logits) or router_logits.dim() != 2 or not 1 <= top_k <= router_logits.shape[1]
            or router_logits.shape[1] > MAX_ROUTE_EXPERTS or router_logits.stride(-1) != 1):
        return native.moe_route(router_logits, top_k, renormalize)
    if torch.compiler.is_compiling():
        return moe_route_op(router_logits, top_k, renormalize)
    return _kernels().moe_route(router_logits, top_k, renormalize)


TRITON_OPS = {
    "rms_norm": rms_norm,
    "fused_add_rms_norm": fused_add_rms_norm,
    "silu_and_mul": silu_and_mul,
    "rotary_embedding": rotary_embedding,
    "rotary_kv_write": rotary_kv_write,
    "greedy_sample": greedy_sample,
    "moe_route": moe_route,
}
