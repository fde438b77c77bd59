"""Deprecated: moved to `backplane.contracts.lora` (and LoraBatchInfo to `backplane.contracts.lora_batch`)
in backplane 0.2 (this alias goes in 0.3)."""

from backplane.deprecation import moved_names

_backend = moved_names(__name__, "backplane.contracts.lora", ("LoraBackend", "LoraBackendContext", "host_offsets"))
_batch = moved_names(__name__, "backplane.contracts.lora_batch", ("LoraBatchInfo",))


def __getattr__(name: str):
    return _batch(name) if name == "LoraBatchInfo" else _backend(name)
