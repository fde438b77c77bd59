"""The attention layer: hands q, k, v and its AttentionLayerInfo to the configured backend, applying
rotary first when given it (fused with the K/V write for a backend that opts in)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from backplane.attention.base import AttentionLayerInfo
from backplane.executor.batch import ForwardBatch
from backplane.ops import opaque


class Attention(nn.Module):
    """One layer's attention (per tensor-parallel rank: num_heads and num_kv_heads are local).

    ctx: any object with an `attn_backend` attribute, read at every call, so the backend can be
    built after the model (it needs the KV pool, which is sized from the model).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float, layer_id: int,
                 ctx, sliding_window: int = 0, logit_softcap: float = 0.0):
        super().__init__()
        self.ctx = ctx
        self.info = AttentionLayerInfo(
            layer_id=layer_id,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            scaling=scaling,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
        )
        self.handle = opaque.register_layer(self)  # for torch.ops.backplane.attention under torch.compile

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
                rotary: Any = None, positions: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, num_heads * head_dim]; k, v: [T, num_kv_heads * head_dim] -> [T, num_heads * head_dim].

        rotary, positions: when given (a RotaryEmbedding and [T] positions), q and k are not rotated
        yet and the layer applies it: fused with the K/V write (the `rotary_kv_write` op) when the
        backend opts in (`fuses_rotary_kv_write`) outside torch.compile, else as `rotary(positions, q, k)`.
        """
        if rotary is not None:
            if not opaque.compiling() and _fuses(self.ctx.attn_backend, batch):
                return self._forward_rotary_kv_write(q, k, v, batch, rotary, positions)
            q, k = rotary(positions, q, k)
        info = self.info
        num_tokens = q.shape[0]
        if opaque.compiling():  # one opaque op: Dynamo never traces the backend's kernels or planning
            out = q.new_empty(num_tokens, info.num_heads, info.head_dim)
            torch.ops.backplane.attention(q.view(num_tokens, info.num_heads, info.head_dim),
                                          k.view(num_tokens, info.num_kv_heads, info.head_dim),
                                          v.view(num_tokens, info.num_kv_heads, info.head_dim), out, self.handle)
            return out.view(num_tokens, info.num_heads * info.head_dim)
        o = self.ctx.attn_backend.forward(
            q.view(num_tokens, info.num_heads, info.head_dim),
            k.view(num_tokens, info.num_kv_heads, info.head_dim),
            v.view(num_tokens, info.num_kv_heads, info.head_dim),
            info,
            batch,
        )
        return o.reshape(num_tokens, info.num_heads * info.head_dim)

    def _forward_rotary_kv_write(self, q, k, v, batch: ForwardBatch, rotary: Any, positions: torch.Tensor):
        info = self.info
        num_tokens = q.shape[0]
        q3 = q.view(num_tokens, info.num_heads, info.head_dim)
        k3 = k.view(num_tokens, info.num_kv_heads, info.head_dim)
        v3 = v.view(num_tokens, info.num_kv_heads, info.head_dim)
        k_cache, v_cache = batch.token_to_kv_pool.get_kv_buffer(info.layer_id)
        q3, k3 = rotary.forward_kv_write(positions, q3, k3, v3, k_cache, v_cache, batch.out_cache_loc)
        o = self.ctx.attn_backend.forward(q3, k3, v3, info, batch, kv_written=True)
        return o.reshape(num_tokens, info.num_heads * info.head_dim)


def _fuses(backend: Any, batch: ForwardBatch) -> bool:
    """Whether `backend` opted in to receive K/V already written by `rotary_kv_write` for `batch`."""
    opted_in = getattr(backend, "fuses_rotary_kv_write", None)
    return opted_in is not None and opted_in(batch)
