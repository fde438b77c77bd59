"""LoRA: the LoraBackend contract, batch info, and (core-side) adapter loading and serving."""

from backplane.lora.base import LoraBackend, LoraBackendContext, host_offsets
from backplane.lora.batch_info import LoraBatchInfo

__all__ = ["LoraBackend", "LoraBackendContext", "LoraBatchInfo", "host_offsets"]
