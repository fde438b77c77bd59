"""Choosing and building a model runner's MoE backend (--moe-backend), for a mixture-of-experts model only.

A MoE model (its config has num_local_experts or num_experts > 0) gets one MoeBackend, shared by
every MoE layer: selected for the model's experts and top-k and the run's device, dtype,
quantization, graphs and compile; set as `ModelContext.moe_backend` before the model is built (the
layers read it at forward time); told of every layer once the model is built (`register_layer`),
and of every layer's weights once the checkpoint is read (the layer's `process_weights_after_loading`).
A dense model builds none: `--moe-backend NAME` is then unused (logged), unless NAME is unknown,
which is an error listing the choices.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from backplane.config import PoolConfig
from backplane.contracts.moe import MoeBackend, MoeBackendContext
from backplane.contracts.quant import QuantConfig, module_matches
from backplane.executor.resources import dtype_name
from backplane.plugin.registry import Registry
from backplane.plugin.runtime import build_first
from backplane.plugin.selection import AUTO, MoeRequirements, Selection, require_known, select_moe_backend
from backplane.settings import EngineArgs

logger = logging.getLogger(__name__)

FLAG = "--moe-backend"


@dataclass(frozen=True)
class MoeShape:
    """A MoE model's experts per layer and experts per token, from its config."""

    num_experts: int
    top_k: int


def moe_shape(hf_config: Any) -> MoeShape | None:
    """The MoeShape of a MoE model's config (num_local_experts: Mixtral; num_experts: Qwen MoE), None
    for a dense model. A MoE config without a valid num_experts_per_tok is refused in one line."""
    experts = getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", None) or 0
    if not isinstance(experts, int) or experts <= 0:
        return None
    top_k = getattr(hf_config, "num_experts_per_tok", None)
    if not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise ValueError(f"model config num_experts_per_tok = {top_k!r}: expected an integer from 1 to the "
                         f"model's {experts} experts")
    return MoeShape(experts, top_k)


def max_moe_tokens(args: EngineArgs, pool: PoolConfig) -> int:
    """The most tokens one forward hands a MoE layer: a prefill chunk (--chunked-prefill-size; the
    extend graphs' buckets are at most that), or every request row, the graph padding row included,
    with a verify's draft tokens each."""
    per_request = args.speculative_num_draft_tokens if args.speculative_algorithm else 1
    return max(args.chunked_prefill_size, (pool.req_rows + 1) * per_request)


@dataclass(frozen=True)
class MoeSetup:
    """What choosing and building the MoE backend of a MoE model reads. quant: the run's quantization
    method name (None: unquantized)."""

    args: EngineArgs
    registry: Registry
    shape: MoeShape
    device: torch.device
    dtype: torch.dtype
    pool: PoolConfig
    quant: str | None = None

    def requirements(self) -> MoeRequirements:
        args = self.args
        return MoeRequirements(
            platform=self.device.type, dtype=dtype_name(self.dtype), num_experts=self.shape.num_experts,
            top_k=self.shape.top_k, quant=self.quant, compile=args.enable_torch_compile,
            graphs=self.device.type == "cuda" and not args.disable_cuda_graph)

    def build(self) -> tuple[MoeBackend, Selection]:
        """The backend (under `auto`, the next usable one when a factory fails) and its selection."""
        choice = select_moe_backend(self.registry, self.args.moe_backend, self.requirements(), FLAG)
        backend, choice = build_first(choice, self.backend_context, kind="moe")
        logger.info("MoE backend %s (plugin %r): %s", choice.spec.name, choice.plugin, choice.reason)
        return backend, choice

    def backend_context(self, choice: Selection) -> MoeBackendContext:
        """What the factory of `choice` is called with (its plugin's options group, if it has one)."""
        group = self.registry.options_group(choice.plugin)
        return MoeBackendContext(dtype=self.dtype, device=self.device, max_num_tokens=max_moe_tokens(self.args, self.pool),
                                 options=self.args.options_for(group) if group else None, quant=self.quant)


def note_dense_model(registry: Registry, name: str) -> None:
    """A dense model: `--moe-backend NAME` is unused (logged), but an unknown NAME is still an error."""
    require_known(registry, "moe", name, FLAG)
    if name != AUTO:
        logger.info("%s %s: unused, the model has no experts", FLAG, name)


def moe_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MoE layers: every module with a `moe_info` (backplane.contracts.MoeLayerInfo)."""
    return [m for m in model.modules() if getattr(m, "moe_info", None) is not None]


def register_moe_layers(model: torch.nn.Module, backend: MoeBackend, quant: QuantConfig | None = None) -> int:
    """`backend.register_layer(layer, layer.moe_info)` for every MoE layer; how many there are.

    quant: the run's QuantConfig. Unless the checkpoint keeps a layer's experts in high precision
    (`quant.ignore` matches `<layer>.experts`), `quant.expert_quant(layer, name)` says how its experts
    are stored and the layer makes them so (`set_expert_quant`) before the checkpoint is read."""
    layers = [(name, m) for name, m in model.named_modules() if getattr(m, "moe_info", None) is not None]
    for name, layer in layers:
        if quant is not None:
            quantize_experts(layer, name, quant)
        backend.register_layer(layer, layer.moe_info)
    return len(layers)


def quantize_experts(layer: torch.nn.Module, name: str, quant: QuantConfig) -> None:
    """Hand the experts of MoE layer `name` to `quant` (nothing when its ignore list keeps them)."""
    if any(module_matches(f"{name}.experts", pattern) for pattern in quant.ignore):
        return
    expert_quant = getattr(quant, "expert_quant", None)  # NOTE: a duck-typed config may lack it
    described = expert_quant(layer, name) if expert_quant is not None else None
    if described is not None:
        layer.set_expert_quant(described)


def process_moe_layers(model: torch.nn.Module) -> None:
    """Each MoE layer's `process_weights_after_loading()` (it hands itself to its backend), once the
    checkpoint is read."""
    for layer in moe_layers(model):
        layer.process_weights_after_loading()
