"""Random FP8 experts for the moe_triton FP8 tests (CPU interpreted and GPU): block-wise (bn x bk
weight blocks, 1 x bk activation groups, `weight_scale_inv`) or per-channel (per-token activations),
as a layer object the backends read, with the torch_native FP8 path as the reference."""

from __future__ import annotations

import types

import torch

from backplane.contracts import ExpertQuant

FP8 = torch.float8_e4m3fn


def expert_quant(fmt: str, block: tuple[int, int] = (16, 16)) -> ExpertQuant:
    if fmt == "block":
        return ExpertQuant("fp8", FP8, scales="block", activations="group", block=block, scale_name="weight_scale_inv")
    return ExpertQuant("fp8", FP8)


def _quantize(w: torch.Tensor, quant: ExpertQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's w [N, K] -> (FP8 [N, K], scales [N] or [N / bn, K / bk]), amax / 448 per row or block."""
    if quant.scales == "channel":
        scale = w.abs().amax(-1).float() / 448
        return (w / scale[:, None]).to(FP8), scale
    bn, bk = quant.block
    n, k = w.shape
    blocks = w.reshape(n // bn, bn, k // bk, bk)
    scale = blocks.abs().amax(dim=(1, 3)).float() / 448
    return (blocks / scale[:, None, :, None]).reshape(n, k).to(FP8), scale


def fp8_layer(fmt: str, num_experts: int, hidden: int, inter: int, gen: torch.Generator, device="cpu",
              block: tuple[int, int] = (16, 16)):
    """A namespace with FP8 w13_weight [E, 2I, H], w2_weight [E, H, I], their scales and moe_info.quant."""
    quant = expert_quant(fmt, block)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    q13, s13 = (torch.stack(t).to(device) for t in zip(*[_quantize(w, quant) for w in w13]))
    q2, s2 = (torch.stack(t).to(device) for t in zip(*[_quantize(w, quant) for w in w2]))
    return types.SimpleNamespace(w13_weight=q13, w2_weight=q2, moe_info=types.SimpleNamespace(quant=quant),
                                 **{f"w13_{quant.scale_name}": s13, f"w2_{quant.scale_name}": s2})


def torch_native(layer, x, weights, ids) -> torch.Tensor:
    """The torch_native backend's FP8 path on `layer` (the reference)."""
    from backplane.moe import TorchNativeMoeBackend

    return TorchNativeMoeBackend().apply(layer, x, weights, ids)
