"""LoRA: the LoraBackend contract, batch info, and (core-side) adapter loading and serving."""

from backplane.contracts.lora import LoraBackend, LoraBackendContext, host_offsets
from backplane.contracts.lora_batch import LoraBatchInfo

__all__ = ["LoraBackend", "LoraBackendContext", "LoraBatchInfo", "host_offsets"]
