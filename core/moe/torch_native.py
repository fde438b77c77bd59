"""The torch_native MoE backend: the reference every MoE backend is held to, a loop over experts.

For each expert that some token chose: gather its tokens, gate/up GEMM, silu(gate) * up, down GEMM,
scale each row by its top-k weight and add it into an fp32 accumulator at its token; cast at the
end. It counts the tokens of each expert on the host (one sync per call) and its shapes depend on
the routing, so it never runs inside a CUDA graph (its spec declares supports_graph=False; the
model's graphs are then refused for a MoE model, or another backend is selected). Any device,
any float dtype; float64 weights and inputs give the suite's reference.

Quantized experts (an `ExpertQuant`: FP8 weights with per-channel or block scales): only the
chosen experts' weights are dequantized, one expert at a time, and each GEMM's input is quantized
and dequantized as a kernel backend quantizes it (`backplane.moe.quant`); the GEMMs then run in
fp32, the intermediate rounded to x's dtype before it is quantized, as a kernel stores it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backplane.contracts.moe import MoeBackend, MoeBackendContext, MoeLayerInfo
from backplane.contracts.quant import ExpertQuant
from backplane.moe.quant import as_quantized_input, dequantize_expert, expert_scales

ACTIVATIONS = ("silu",)


def check_moe_inputs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor) -> None:
    """One-line errors for inputs that do not follow the MoeBackend.apply contract (shapes, dtypes)."""
    if x.dim() != 2:
        raise ValueError(f"MoE: x must be [num_tokens, hidden_size], got shape {tuple(x.shape)}")
    num_tokens, hidden = x.shape
    if w13.dim() != 3 or w2.dim() != 3 or w13.shape[2] != hidden or w2.shape[:2] != (w13.shape[0], hidden) \
            or w13.shape[1] != 2 * w2.shape[2]:
        raise ValueError(f"MoE: expected w13_weight [E, 2 * I, H={hidden}] and w2_weight [E, H, I], got "
                         f"{tuple(w13.shape)} and {tuple(w2.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"MoE: expected topk_weights and topk_ids [num_tokens={num_tokens}, top_k], got "
                         f"{tuple(topk_weights.shape)} and {tuple(topk_ids.shape)}")
    if topk_weights.dtype != torch.float32 or topk_ids.dtype != torch.int32:
        raise ValueError(f"MoE: expected topk_weights float32 and topk_ids int32 (as backplane.moe.route returns), "
                         f"got {topk_weights.dtype} and {topk_ids.dtype}")


def moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, quant: ExpertQuant | None = None, w13_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, H]; w13: [E, 2 * I, H] (gate rows, then up rows); w2: [E, H, I]; topk_weights: [T, k]
    fp32; topk_ids: [T, k] int32 -> [T, H] in x's dtype:
    out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(gate_e @ x[t]) * (up_e @ x[t])), e = topk_ids[t, j].

    GEMMs in x's dtype, the weighted sum in fp32 (float64 when x is). T may be 0; experts no token
    chose cost nothing. quant, w13_scale, w2_scale: quantized experts (ExpertQuant's layout): the
    weights are dequantized, the inputs of both GEMMs quantized as `quant.activations` says.
    """
    check_moe_inputs(x, w13, w2, topk_weights, topk_ids)
    num_tokens, top_k = topk_ids.shape
    num_experts, inter = w13.shape[0], w2.shape[2]
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    out = torch.zeros(x.shape, dtype=acc_dtype, device=x.device)
    if num_tokens == 0:
        return out.to(x.dtype)
    flat_ids = topk_ids.reshape(-1).long()  # [T * k]: token t's j-th choice at t * k + j
    lowest, highest = torch.stack([flat_ids.min(), flat_ids.max()]).tolist()  # NOTE: host sync
    if lowest < 0 or highest >= num_experts:
        raise ValueError(f"MoE: topk_ids out of range; expected expert ids in [0, {num_experts}), got "
                         f"{lowest}..{highest}")
    order = torch.argsort(flat_ids, stable=True)  # the choices grouped by expert
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    tokens_of = order // top_k  # [T * k]: the token of each grouped choice
    weights_of = topk_weights.reshape(-1)[order]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        start += count
        tokens = tokens_of[rows]
        if quant is None:
            y = _expert(x.index_select(0, tokens), w13[expert], w2[expert], inter)  # [n, H]
        else:
            y = _quantized_expert(x.index_select(0, tokens), expert, w13, w2, w13_scale, w2_scale, quant)
        out.index_add_(0, tokens, y.to(acc_dtype) * weights_of[rows, None].to(acc_dtype))
    return out.to(x.dtype)


def _expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, inter: int) -> torch.Tensor:
    """x [n, H] -> [n, H]: down(silu(gate x) * up x) in x's dtype."""
    gate_up = x @ w13.t()  # [n, 2 * I]
    return (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ w2.t()


def _quantized_expert(x: torch.Tensor, expert: int, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
                      w2_scale: torch.Tensor, quant: ExpertQuant) -> torch.Tensor:
    """x [n, H] -> fp32 [n, H] through expert `expert`'s dequantized weights, each GEMM's input
    quantized and dequantized (the intermediate first rounded to x's dtype, as a kernel stores it)."""
    inter = w2.shape[2]
    gate_up = as_quantized_input(x, quant) @ dequantize_expert(w13[expert], w13_scale[expert], quant).t()
    hidden = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(x.dtype)  # [n, I]
    return as_quantized_input(hidden, quant) @ dequantize_expert(w2[expert], w2_scale[expert], quant).t()


class TorchNativeMoeBackend(MoeBackend):
    """The reference MoE backend (`moe_reference` over the layer's `w13_weight` / `w2_weight`, and
    their scales when the experts are quantized)."""

    def __init__(self, ctx: MoeBackendContext | None = None):
        self.ctx = ctx

    def register_layer(self, layer: torch.nn.Module, info: MoeLayerInfo) -> None:
        if info.activation not in ACTIVATIONS:
            raise ValueError(f"torch_native MoE backend: layer {info.layer_id} activation {info.activation!r} is "
                             f"not supported; expected one of {', '.join(ACTIVATIONS)}")

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        scales = expert_scales(layer)
        if scales is None:
            return moe_reference(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids)
        return moe_reference(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, *scales)
