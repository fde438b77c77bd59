"""The attention layer: hands q, k, v and its AttentionLayerInfo to the configured backend."""

from __future__ import annotations

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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """q: [T, num_heads * head_dim]; k, v: [T, num_kv_heads * head_dim] -> [T, num_heads * head_dim]."""
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
