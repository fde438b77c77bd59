"""FlashInfer implementations of the custom ops, with the signatures of `backplane.ops.native`.

flashinfer is imported on the first call, never when the op is registered. Inputs FlashInfer's
kernels do not take (fp32, CPU tensors, empty batches) go to the native implementation.
"""

from __future__ import annotations

import torch

from backplane.ops import native

_KERNEL_DTYPES = (torch.float16, torch.bfloat16)
_GELU_APPROXIMATIONS = ("none", "tanh")


def _has_kernel(*tensors: torch.Tensor) -> bool:
    """FlashInfer's kernels take non-empty fp16/bf16 CUDA tensors of one dtype."""
    first = tensors[0]
    return (
        first.is_cuda
        and first.dtype in _KERNEL_DTYPES
        and first.numel() > 0
        and all(t.is_cuda and t.dtype == first.dtype for t in tensors)
    )


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x: [..., hidden] -> [rows, hidden] with a unit last stride (a view when possible)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight. x: [..., hidden]; weight: [hidden]."""
    if not _has_kernel(x):
        return native.rms_norm(x, weight, eps)
    import flashinfer

    y = flashinfer.rmsnorm(_rows(x), weight.to(x.dtype), eps)
    return y.reshape(x.shape)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual_out = x + residual; y = rms_norm(residual_out). Returns (y, residual_out).

    NOTE: FlashInfer's kernel works in place, so on the FlashInfer path the inputs are consumed:
    `x` holds y and `residual` holds residual_out afterwards (when they are contiguous), and the
    returned tensors share their storage. Callers must use the returned tensors only.
    """
    if not _has_kernel(x, residual):
        return native.fused_add_rms_norm(x, residual, weight, eps)
    import flashinfer

    x_rows, residual_rows = _rows(x), _rows(residual)
    flashinfer.fused_add_rmsnorm(x_rows, residual_rows, weight.to(x.dtype), eps)
    return x_rows.view(x.shape), residual_rows.view(residual.shape)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * d] -> silu(x[..., :d]) * x[..., d:]: [..., d]."""
    if not _has_kernel(x):
        return native.silu_and_mul(x)
    import flashinfer

    return flashinfer.silu_and_mul(x.contiguous())


def gelu_and_mul(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """x: [..., 2 * d] -> gelu(x[..., :d]) * x[..., d:]: [..., d]; approximate is "none" or "tanh"."""
    if approximate not in _GELU_APPROXIMATIONS:
        raise ValueError(f"gelu_and_mul: approximate: expected one of {_GELU_APPROXIMATIONS}, got {approximate!r}")
    if not _has_kernel(x):
        return native.gelu_and_mul(x, approximate)
    import flashinfer

    kernel = flashinfer.gelu_tanh_and_mul if approximate == "tanh" else flashinfer.gelu_and_mul
    return kernel(x.contiguous())


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first rotary_dim dims of every head of q and k; returns new tensors (q, k).

    positions: [T] int32/int64; q: [T, num_heads, head_dim]; k: [T, num_kv_heads, head_dim];
    cos_sin_cache: [max_position, rotary_dim] fp32 (cos in the first half, sin in the second).
    """
    head_dim = q.shape[-1]
    if (not _has_kernel(q, k) or not cos_sin_cache.is_cuda
            or not _rope_kernel_fits(head_dim, cos_sin_cache.shape[-1], q.dtype)):
        return native.rotary_embedding(positions, q, k, cos_sin_cache, is_neox)
    import flashinfer

    # FlashInfer views q as [T, -1, head_dim] and reads fp32 cos/sin rows; both need unit strides.
    q_rot, k_rot = flashinfer.apply_rope_with_cos_sin_cache(
        positions.contiguous(),
        _last_dim_contiguous(q),
        _last_dim_contiguous(k),
        head_dim,
        cos_sin_cache.float().contiguous(),
        is_neox=is_neox,
    )
    return q_rot.view(q.shape), k_rot.view(k.shape)


def _rope_kernel_fits(head_dim: int, rotary_dim: int, dtype: torch.dtype) -> bool:
    """Whether FlashInfer's apply_rope_with_cos_sin_cache rotates heads of `head_dim` (the first
    `rotary_dim` of each) in `dtype` correctly.

    Each of its threads rotates a run of `vec` consecutive elements with one sign, the one of the
    half of rotary_dim its first element lies in, and reads its partners (and cos/sin) as `vec`
    values from there, so every run must lie inside one half: rotary_dim a multiple of 2 * vec.
    vec is max(16 bytes, head_dim / 32) elements for head dims 64/128/256/512; other head dims go to
    its RopeQuantize kernel with 32 bytes a thread (taken here only when the whole head rotates).
    NOTE: head_dim 16 in bf16 (vec 16) failed this silently: the second half of every head came
    out as x[8+j] * sin - x[16+j] * cos(next position), x[16+j] being the next head's (FlashInfer
    0.6.18's source; the tiny GPU LoRA-over-FP8 test's logits 0.39 relative off, as emulated on CPU).
    """
    size = torch.empty((), dtype=dtype).element_size()
    if head_dim in (64, 128, 256, 512):
        vec = max(16 // size, head_dim // 32)
    elif rotary_dim == head_dim:
        vec = 32 // size
    else:
        return False
    return rotary_dim % (2 * vec) == 0


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
