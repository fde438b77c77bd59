"""Gated activations calling the resolved custom ops."""

from __future__ import annotations

import torch
from torch import nn


class SiluAndMul(nn.Module):
    """x: [..., 2 * d] -> silu(x[..., :d]) * x[..., d:]. ctx.ops is read at every call."""

    def __init__(self, ctx):
        super().__init__()
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ctx.ops.silu_and_mul(x)
