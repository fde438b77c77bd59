"""The contracts: what the layers above meet through, on the ground floor of the house.

Nothing here imports anything of backplane outside `backplane.contracts` (tests/test_layering.py
checks it), so every package above (layers, models, executor, engine, plugins) may import them.

- `batch`: ForwardMode, ForwardBatch (a forward's inputs), HostBatch
- `forward_context`: ForwardContext, the one per-forward binding (backend, LoRA info, ops, outputs)
- `memory`: ReqToTokenPool, TokenToKVPool
- `attention`: the AttentionBackend ABC, AttentionLayerInfo, AttentionBackendContext
- `lora`, `lora_batch`: the LoraBackend ABC, LoraBackendContext, LoraBatchInfo
- `graph`: GraphKey, GraphParticipant, ModeLimit
- `model`: ModelOutput
- `protocols`: the collaborators' Protocols (GraphContributor, SchedulerParticipant, ...)
- `moe`: the MoeBackend ABC (a MoE kernel), MoeLayerInfo, MoeBackendContext
- `quant`: QuantMethod (a quantized linear layer), QuantConfig, QuantContext, ShardLayout, LinearPartition,
  ExpertQuant (how a MoE layer's quantized experts are stored)
"""

from backplane.contracts.attention import AttentionBackend, AttentionBackendContext, AttentionLayerInfo
from backplane.contracts.batch import ForwardBatch, ForwardMode, HostBatch
from backplane.contracts.forward_context import ForwardContext, ForwardSlot, NestedForwardError
from backplane.contracts.graph import GraphKey, GraphParticipant, ModeLimit
from backplane.contracts.lora import LoraBackend, LoraBackendContext, host_offsets
from backplane.contracts.lora_batch import LoraBatchInfo, LoraSegments
from backplane.contracts.memory import ReqToTokenPool, TokenToKVPool
from backplane.contracts.model import ModelOutput
from backplane.contracts.moe import MoeBackend, MoeBackendContext, MoeLayerInfo
from backplane.contracts.protocols import ForwardRouter, GraphContributor, RunningRequests, SchedulerParticipant
from backplane.contracts.quant import (
    ExpertQuant, LinearPartition, QuantConfig, QuantContext, QuantMethod, ShardLayout, new_parameter,
)

__all__ = [
    "AttentionBackend", "AttentionBackendContext", "AttentionLayerInfo", "ExpertQuant", "ForwardBatch", "ForwardMode",
    "ForwardContext", "ForwardRouter", "ForwardSlot", "GraphContributor", "GraphKey", "GraphParticipant", "HostBatch", "LoraBackend",
    "LinearPartition", "LoraBackendContext", "LoraBatchInfo", "LoraSegments", "ModeLimit", "ModelOutput", "MoeBackend",
    "MoeBackendContext", "MoeLayerInfo", "NestedForwardError",
    "QuantConfig", "QuantContext", "QuantMethod", "ReqToTokenPool", "RunningRequests",
    "SchedulerParticipant", "ShardLayout", "TokenToKVPool", "host_offsets", "new_parameter",
]
