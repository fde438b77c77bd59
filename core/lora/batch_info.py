"""Deprecated: moved to `backplane.contracts.lora_batch` in backplane 0.2 (this alias goes in 0.3)."""

from backplane.deprecation import moved_names

__getattr__ = moved_names(__name__, "backplane.contracts.lora_batch", ("LoraBatchInfo",))
