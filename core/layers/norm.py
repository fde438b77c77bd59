"""RMSNorm calling the resolved `rms_norm` / `fused_add_rms_norm` custom ops."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """weight: [hidden_size], ones until loaded.

    ctx: any object with an `ops` attribute (a CustomOps table), read at every call, so the model
    runner can swap the table (to the native one for torch.compile, say) after building the model.
    """

    def __init__(self, hidden_size: int, eps: float, ctx, params_dtype=None):
        super().__init__()
        self.ctx = ctx
        self.eps = eps
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x: [..., hidden]. Without residual returns y; with it returns (y, x + residual)."""
        if residual is None:
            return self.ctx.ops.rms_norm(x, self.weight, self.eps)
        return self.ctx.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
