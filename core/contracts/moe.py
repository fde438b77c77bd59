"""The mixture-of-experts contract: the core routes, a MoE backend dispatches, computes and combines.

A MoE kernel plugin registers a `MoeBackendSpec` (backplane.plugin.registry) through the hook
`backplane_register_moe_backends`; its factory gets a `MoeBackendContext` and returns a
`MoeBackend`, one object per model, shared by every MoE layer of it (`--moe-backend NAME|auto`).

The core's `FusedMoE` layer (backplane.layers) owns everything a model decides:
- the router: the gate's logits ([T, E], in the model's dtype, never quantized), softmax in fp32,
  top-k, and renormalisation of the k weights when the model asks (`MoeLayerInfo.renormalize`);
- the experts' weights, stacked at load from per-expert checkpoint tensors:
  `layer.w13_weight` [E, 2 * I_local, H] (gate rows, then up rows) and `layer.w2_weight`
  [E, H, I_local], I_local the intermediate size of this tensor-parallel rank;
- the shared expert (Qwen2-MoE) and the all-reduce of the partial sums under tensor parallelism.

The backend owns the rest: given the tokens `x` [T, H], `topk_weights` [T, k] (fp32) and
`topk_ids` [T, k] (int32), it returns `sum_j topk_weights[t, j] * expert_{ids[t, j]}(x[t])`
([T, H], x's dtype), each expert being `down(silu(gate(x)) * up(x))` on this rank's slice of the
intermediate dimension (a partial sum the layer all-reduces). The torch reference is
`backplane.moe.torch_native`; `backplane.testing.moe_conformance` holds any backend to it.

Quantized experts: when the run's quantization method describes the experts
(`QuantConfig.expert_quant`, a `backplane.contracts.ExpertQuant`), the layer's `w13_weight` /
`w2_weight` hold its `weight_dtype` (FP8) and the layer also has `w13_<scale_name>` /
`w2_<scale_name>` (fp32 scales, per channel or per block); `MoeLayerInfo.quant` is that
description. Only a backend whose spec declares the method in `quant_methods` is selected for such
a run; it computes sum_j weight_j * expert(x) with the dequantized weights, its activations
quantized as `ExpertQuant.activations` says (`backplane.moe.quantize_activations`).

Nothing here imports anything of backplane above `backplane.contracts`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from backplane.contracts.quant import ExpertQuant


@dataclass(frozen=True)
class MoeLayerInfo:
    """What a backend knows of one MoE layer (sizes in elements).

    num_experts: E. top_k: experts per token. hidden_size: H. intermediate_size: the full expert
    intermediate size; intermediate_size_per_partition: this rank's slice of it (I_local).
    renormalize: the router renormalises the k weights to sum to 1 (informational: the weights the
    backend receives are final). activation: "silu" (SwiGLU experts). layer_id: the decoder layer.
    params_dtype: the experts' weights dtype before any quantization; device: where they live.
    quant: how the experts' weights are quantized (None: the model dtype).
    """

    layer_id: int
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    intermediate_size_per_partition: int
    renormalize: bool
    params_dtype: torch.dtype
    device: torch.device
    activation: str = "silu"
    tp_rank: int = 0
    tp_size: int = 1
    quant: ExpertQuant | None = None


@dataclass(frozen=True)
class MoeBackendContext:
    """What a MoeBackendSpec's factory receives.

    dtype, device: the run's. max_num_tokens: the most tokens one forward hands a MoE layer
    (static buffers for CUDA graphs are sized from it). options: the plugin's settings group, if
    any. quant: the name of the run's quantization method, or None (unquantized experts).
    """

    dtype: torch.dtype
    device: torch.device
    max_num_tokens: int
    options: Any = None
    quant: str | None = None


class MoeBackend(ABC):
    """Dispatch, the grouped expert GEMMs and the weighted combine, for every MoE layer of a model.

    `register_layer` is called once per layer after the model is built (allocate per-layer state,
    or shared workspaces sized by `ctx.max_num_tokens`); `process_weights_after_loading` once per
    layer after the checkpoint is read (re-layout or pre-pack weights; keep the tensors' names);
    `apply` on every forward. `apply` must be capturable in a CUDA graph (no host sync, no
    allocation whose size depends on the routing) when the spec declares supports_graph.
    """

    def register_layer(self, layer: torch.nn.Module, info: MoeLayerInfo) -> None:
        """Once per MoE layer, after the model is built; `layer.moe_info` is `info`."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Once per MoE layer, after the checkpoint is read."""

    @abstractmethod
    def apply(self, layer: torch.nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """x: [T, H]; topk_weights: [T, k] fp32; topk_ids: [T, k] int32 -> [T, H] in x's dtype:
        the weighted sum of each token's k experts over `layer.w13_weight` / `layer.w2_weight`
        (this rank's partial sum under tensor parallelism). T may be 0."""
