"""Gated activations calling the resolved custom ops."""

from __future__ import annotations

import torch
from torch import nn

GELU_APPROXIMATIONS = ("none", "tanh")


class SiluAndMul(nn.Module):
    """x: [..., 2 * d] -> silu(x[..., :d]) * x[..., d:]. ctx.ops is read at every call."""

    def __init__(self, ctx):
        super().__init__()
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ctx.ops.silu_and_mul(x)


class GeluAndMul(nn.Module):
    """x: [..., 2 * d] -> gelu(x[..., :d]) * x[..., d:] (GeGLU). ctx.ops is read at every call.

    approximate: "none" (exact GELU, transformers' "gelu") or "tanh" (transformers'
    "gelu_pytorch_tanh", Gemma's activation).
    """

    def __init__(self, ctx, approximate: str = "none"):
        super().__init__()
        if approximate not in GELU_APPROXIMATIONS:
            raise ValueError(f"GeluAndMul approximate: expected one of {GELU_APPROXIMATIONS}, got {approximate!r}")
        self.ctx = ctx
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ctx.ops.gelu_and_mul(x, self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"
