"""backplane: an LLM model executor whose every backend is a plugin.

The public API: markers and specs for plugin authors, Engine and SamplingParams for users.
Heavy modules (the engine, kernels) load on first use, so `import backplane` stays light.
"""

from __future__ import annotations

from typing import Any

from backplane.plugin.hookspecs import hookimpl, hookspec
from backplane.plugin.registry import (
    ALL_MODES,
    AttentionBackendSpec,
    CustomOpImpl,
    LoraBackendSpec,
    ModelSpec,
    SpecAlgorithmSpec,
)
from backplane.settings import EngineArgs, ServerArgs  # ServerArgs: deprecated alias of EngineArgs

__version__ = "0.1.0"

_LAZY = {
    "AsyncEngine": "backplane.engine",
    "Engine": "backplane.engine",
    "SamplingParams": "backplane.engine",
    "ForwardBatch": "backplane.contracts.batch",
    "ForwardMode": "backplane.contracts.batch",
    "AttentionBackend": "backplane.contracts.attention",
    "capture_graph": "backplane.executor.graph_runner",
    "ReqToTokenPool": "backplane.contracts.memory",
    "TokenToKVPool": "backplane.contracts.memory",
}

__all__ = [
    "ALL_MODES",
    "AttentionBackendSpec",
    "CustomOpImpl",
    "LoraBackendSpec",
    "ModelSpec",
    "EngineArgs",
    "ServerArgs",
    "SpecAlgorithmSpec",
    "hookimpl",
    "hookspec",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'backplane' has no attribute {name!r}")
