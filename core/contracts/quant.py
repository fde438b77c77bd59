"""The quantization contract: a method per linear layer, made by a config read from the checkpoint.

A quantization plugin registers a `QuantMethodSpec` (backplane.plugin.registry); its factory gets a `QuantContext` (the
checkpoint's `quantization_config`, or None for online quantization of a bf16 checkpoint) and
returns a `QuantConfig`. The core walks the model's linear layers, decides which stay in high
precision (the config's `ignore` patterns; lm_head and embeddings are never linear layers here),
and asks `QuantConfig.method_for(layer, prefix)` for the others. The method then owns the
layer: it creates the weights and scales (`create_weights`), which the layer's own
`weight_loader` fills from full checkpoint tensors by each parameter's `ShardLayout` (tensor-parallel
shards and the q/k/v or gate/up parts of fused layers included), fixes them up once
(`process_weights_after_loading`) and computes the layer (`apply`).

A mixture-of-experts layer's experts are not linear layers: the core asks
`QuantConfig.expert_quant(layer, prefix)` for an `ExpertQuant`, a description of how the experts'
weights and scales are stored (data, no code). The core's `FusedMoE` creates and loads those
tensors, and the model's MoE backend (one declaring the method's name in `quant_methods`) computes
with them (backplane.contracts.moe).

Nothing here imports anything of backplane above `backplane.contracts`.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ShardLayout:
    """How a linear layer's parameter maps onto the full checkpoint tensor (`param.shard_layout`).

    output_dim: the dim that runs along the weight's output rows, split over ranks of a
      column-parallel layer and over the parts of a fused one; None when it does not (a per-tensor
      scale). input_dim: the dim along the input columns, split by a row-parallel layer; None when
      not split (a bias, a per-channel scale). output_block, input_block: weight rows / columns per
      element along those dims (1 for a weight or a per-channel scale; 128 for 128x128 block scales).
    per_partition: one element per logical output part ([q, k, v] of a fused QKV, [gate, up]):
      a per-tensor scale, loaded at the part's index (a row-parallel or unfused layer has one part).
    """

    output_dim: int | None = 0
    input_dim: int | None = None
    output_block: int = 1
    input_block: int = 1
    per_partition: bool = False


WEIGHT_LAYOUT = ShardLayout(output_dim=0, input_dim=1)
VECTOR_LAYOUT = ShardLayout(output_dim=0)  # a bias, a per-channel [out, 1] scale
PER_PARTITION_LAYOUT = ShardLayout(output_dim=None, per_partition=True)


def layout_of(param: torch.Tensor) -> ShardLayout:
    """`param.shard_layout`, else the layout of an unquantized weight (2-D) or bias (1-D)."""
    layout = getattr(param, "shard_layout", None)
    if layout is not None:
        return layout
    return WEIGHT_LAYOUT if param.dim() == 2 else VECTOR_LAYOUT


def new_parameter(data: torch.Tensor, layout: ShardLayout) -> torch.nn.Parameter:
    """A frozen nn.Parameter over `data` carrying `layout` (what a QuantMethod registers on a layer)."""
    param = torch.nn.Parameter(data, requires_grad=False)
    param.shard_layout = layout
    return param


@dataclass(frozen=True)
class LinearPartition:
    """What a QuantMethod knows of the linear layer it creates weights for (all sizes in elements).

    input_size, output_size: the full (unsplit) sizes. input_size_per_partition: this rank's input
    columns (split by a row-parallel layer). output_partition_sizes: this rank's rows of each logical
    output ([q, k, v], [gate, up], or one entry). parallel: "column" or "row". params_dtype: the
    model's dtype (activations, bias). device: where the parameters go.
    """

    input_size: int
    output_size: int
    input_size_per_partition: int
    output_partition_sizes: tuple[int, ...]
    parallel: str
    tp_rank: int
    tp_size: int
    params_dtype: torch.dtype
    device: torch.device

    @property
    def output_size_per_partition(self) -> int:
        return sum(self.output_partition_sizes)


class QuantMethod(ABC):
    """One linear layer's quantized weights and arithmetic (one object per layer).

    The layer calls `create_weights` once when it is quantized (its own `weight` is gone by then),
    its `weight_loader` fills every parameter registered here by `ShardLayout`, the core calls
    `process_weights_after_loading` once after the checkpoint is read, and every forward calls
    `apply`. `apply` must be capturable in a CUDA graph when the spec declares supports_graph.
    """

    @abstractmethod
    def create_weights(self, layer: torch.nn.Module, partition: LinearPartition) -> None:
        """Register the weight and its scales on `layer` (`new_parameter(..., layout)`), named as in
        the checkpoint (`weight`, `weight_scale`, `input_scale`, `weight_scale_inv`, ...)."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Once, after loading: combine per-part scales, transpose or quantize (online methods)."""

    @abstractmethod
    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x: [..., input_size_per_partition] in the model dtype -> [..., output_size_per_partition]
        in the same dtype (x W^T + bias, W the dequantized weight)."""


@dataclass(frozen=True)
class QuantContext:
    """What a QuantMethodSpec's factory receives.

    checkpoint_config: config.json's `quantization_config` (a dict), or None when a bf16 checkpoint
    is quantized online. dtype, device: the run's. options: the plugin's settings group, if any.
    """

    checkpoint_config: dict[str, Any] | None
    dtype: torch.dtype
    device: torch.device
    options: Any = None


EXPERT_SCALES = ("channel", "block")
EXPERT_ACTIVATIONS = ("token", "group")


@dataclass(frozen=True)
class ExpertQuant:
    """How a quantization method stores a MoE layer's expert weights (`QuantConfig.expert_quant`).

    The layer's stacked `w13_weight` [E, 2 * I_local, H] and `w2_weight` [E, H, I_local] hold
    `weight_dtype` values w_q, and the dequantized weight is w_q * scale, the scales fp32 and named
    `w13_<scale_name>` / `w2_<scale_name>` (the checkpoint's per-expert `<scale_name>` tensors stacked):
      scales "channel": one scale per output row: [E, 2 * I_local] and [E, H] (a checkpoint's
        per-channel [N, 1] or per-tensor [1] scale of each expert's projection fills its rows);
      scales "block": one per `block` = (bn, bk) tile: [E, 2 * I_local / bn, H / bk] (gate blocks,
        then up blocks) and [E, H / bn, I_local / bk]; bn and bk divide H and I_local.
    activations: how the backend quantizes each GEMM's input (dynamic, computed per call):
      "token" one scale per row, "group" one per row and run of bk columns.
    online: the checkpoint holds the weights in the model dtype; the layer quantizes them after
      loading, per channel or per block as `scales` says.
    method: the quantization method's name (what a MoE backend's `quant_methods` declares).
    """

    method: str
    weight_dtype: torch.dtype
    scales: str = "channel"
    activations: str = "token"
    block: tuple[int, int] | None = None
    scale_name: str = "weight_scale"
    online: bool = False

    def __post_init__(self):
        if self.scales not in EXPERT_SCALES or self.activations not in EXPERT_ACTIVATIONS:
            raise ValueError(f"ExpertQuant: scales {self.scales!r}, activations {self.activations!r}; expected "
                             f"scales one of {', '.join(EXPERT_SCALES)} and activations one of "
                             f"{', '.join(EXPERT_ACTIVATIONS)}")
        if (self.scales == "block") != (self.block is not None) or (self.activations == "group") != (self.block is not None):
            raise ValueError(f"ExpertQuant: scales {self.scales!r}, activations {self.activations!r} with block "
                             f"{self.block}: expected block (bn, bk) exactly with scales 'block' and activations 'group'")


class QuantConfig(ABC):
    """A quantization method made for one checkpoint: which layers it skips, a method per layer.

    `ignore`: module names or patterns kept in high precision, as the checkpoint names them
    (q_proj, not the fused qkv_proj): an exact or dotted-suffix name ("lm_head", "mlp.down_proj"),
    or "re:" and a regular expression matched against the whole name (compressed-tensors).
    """

    name: str = ""

    @property
    def ignore(self) -> tuple[str, ...]:
        return ()

    @abstractmethod
    def method_for(self, layer: torch.nn.Module, prefix: str) -> QuantMethod | None:
        """The method for the linear layer named `prefix` (None: leave it in high precision)."""

    def expert_quant(self, layer: torch.nn.Module, prefix: str) -> ExpertQuant | None:
        """How the experts of the MoE layer named `prefix` ("model.layers.0.mlp") are stored, or None:
        in the model dtype (the default). Raise ValueError, one line, for a layout the method knows
        but cannot describe."""
        return None


def module_matches(name: str, pattern: str) -> bool:
    """Whether checkpoint module `name` ("model.layers.0.mlp.down_proj") matches an ignore `pattern`:
    "re:REGEX" matched in full, else the name itself or a dotted run of its parts ("lm_head",
    "mlp.down_proj", "model.layers.0")."""
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    return f".{pattern}." in f".{name}."
