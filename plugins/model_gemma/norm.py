"""Gemma's RMSNorm: the weight is stored as an offset from one, y = x / rms(x) * (1 + w).

Plain torch, fp32 inside like transformers' Gemma norm: the checkpoint's `w` is kept as loaded and
`1 + w` is formed in fp32 at each call, so a bf16 run does not round `1 + w` to bf16 (folding the one
into the weight at load time would, and would lose the small offsets' precision). Under
torch.compile Inductor fuses it; on the eager path it is a few elementwise kernels.
"""

from __future__ import annotations

import torch
from torch import nn


class GemmaRMSNorm(nn.Module):
    """weight: [hidden_size], zeros until loaded (a scale of one)."""

    def __init__(self, hidden_size: int, eps: float, params_dtype=None):
        super().__init__()
        self.eps = eps
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., hidden_size] -> y of x's shape and dtype."""
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
