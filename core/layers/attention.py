"""The attention layer: hands q, k, v and its AttentionLayerInfo to the configured backend, applying
rotary first when given it (fused with the K/V write for a backend that opts in)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from backplane.contracts.attention import AttentionBackend, AttentionLayerInfo
from backplane.contracts.batch import ForwardBatch
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
        backend opts in (`fuses_rotary_kv_write`), else as `rotary(positions, q, k)`. Under torch.compile
        the backend runs behind an opaque op: `rotary_attention` (rotary inside it, so the fused write
        stays) for a backend that may opt in, else Inductor's rotary and then `attention`.
        """
        if not opaque.compiling():
            return self.attend(q, k, v, batch, rotary, positions)
        if rotary is not None:
            if _may_fuse(self.ctx.attn_backend):  # rotary inside the opaque op, fused with the K/V write
                return torch.ops.backplane.rotary_attention(q, k, v, positions, self.handle, rotary.handle)
            q, k = rotary(positions, q, k)
        info = self.info
        num_tokens = q.shape[0]
        out = q.new_empty(num_tokens, info.num_heads, info.head_dim)  # one opaque op: Dynamo never traces the backend
        torch.ops.backplane.attention(q.view(num_tokens, info.num_heads, info.head_dim),
                                      k.view(num_tokens, info.num_kv_heads, info.head_dim),
                                      v.view(num_tokens, info.num_kv_heads, info.head_dim), out, self.handle)
        return out.view(num_tokens, info.num_heads * info.head_dim)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, rotary: Any = None,
               positions: torch.Tensor | None = None) -> torch.Tensor:
        """The eager path of `forward` (also what torch.ops.backplane.rotary_attention runs)."""
        if rotary is not None:
            if _fuses(self.ctx.attn_backend, batch):
                return self._forward_rotary_kv_write(q, k, v, batch, rotary, positions)
            q, k = rotary(positions, q, k)
        info = self.info
        num_tokens = q.shape[0]
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


def _may_fuse(backend: Any) -> bool:
    """Whether `backend`'s class overrides `fuses_rotary_kv_write`: a constant of the class, which
    Dynamo folds while tracing; the per-batch answer is asked at run time, inside the opaque op."""
    opted_in = getattr(type(backend), "fuses_rotary_kv_write", None)
    return opted_in is not None and opted_in is not AttentionBackend.fuses_rotary_kv_write


def _fuses(backend: Any, batch: ForwardBatch) -> bool:
    """Whether `backend` opted in to receive K/V already written by `rotary_kv_write` for `batch`."""
    opted_in = getattr(backend, "fuses_rotary_kv_write", None)
    return opted_in is not None and opted_in(batch)
