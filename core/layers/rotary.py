"""Rotary position embedding layer: a cos/sin cache plus the `rotary_embedding` custom op."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from backplane.ops import opaque
from backplane.ops.rope import shared_cos_sin_cache


class RotaryEmbedding(nn.Module):
    """Rotates q and k by their positions.

    cos_sin_cache: [max_position, rotary_dim] fp32 buffer (not in the state dict) on the current
    default device, one tensor shared by every layer with the same rotary config (read only).
    ctx.ops is read at every call.
    """

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float,
                 rope_scaling: dict[str, Any] | None, is_neox: bool, ctx):
        super().__init__()
        if rotary_dim > head_dim:
            raise ValueError(f"rotary_dim: expected at most head_dim={head_dim}, got {rotary_dim}")
        self.ctx = ctx
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.is_neox = is_neox
        self.cache_args = (rotary_dim, max_position, base, rope_scaling)
        cache = shared_cos_sin_cache(*self.cache_args, torch.empty(0).device)
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        self.handle = opaque.register_layer(self)  # for torch.ops.backplane.rotary_attention under torch.compile

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions: [T]; q: [T, num_heads * head_dim]; k: [T, num_kv_heads * head_dim] -> same shapes."""
        num_tokens = positions.shape[0]
        q3 = q.view(num_tokens, -1, self.head_dim)
        k3 = k.view(num_tokens, -1, self.head_dim)
        q3, k3 = self.ctx.ops.rotary_embedding(positions, q3, k3, self.cos_sin_cache, self.is_neox)
        return q3.reshape(q.shape), k3.reshape(k.shape)

    def forward_kv_write(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor):
        """The `rotary_kv_write` op: rotate q: [T, H, D] and k: [T, H_kv, D], write the rotated k and
        v: [T, H_kv, D] into k_cache / v_cache at slots loc: [T]; returns the rotated (q, k)."""
        return self.ctx.ops.rotary_kv_write(positions, q, k, v, self.cos_sin_cache, self.is_neox,
                                            k_cache, v_cache, loc)

    def _apply(self, fn, recurse=True):
        # NOTE: a model-wide .to(dtype) / .half() must not round the fp32 cache: follow only the
        # device change, to the cache shared on that device.
        out = super()._apply(fn, recurse)
        self.cos_sin_cache = shared_cos_sin_cache(*self.cache_args, self.cos_sin_cache.device)
        return out
