"""backplane: an LLM model executor whose every backend is a plugin.

The public API: markers and specs for plugin authors, Engine and SamplingParams for users.
Heavy modules (the engine, kernels) load on first use, so `import backplane` stays light.
"""

from __future__ import annotations

from typing import Any

from backplane.deprecation import renamed_names
from backplane.plugin.hookspecs import hookimpl, hookspec
from backplane.plugin.registry import (
    ALL_MODES,
    AttentionBackendSpec,
    CustomOpImpl,
    LoraBackendSpec,
    ModelSpec,
    MoeBackendSpec,
    QuantMethodSpec,
    SpecAlgorithmSpec,
)
from backplane.plugin.version import PLUGIN_API_VERSION
from backplane.settings import EngineArgs

__version__ = "0.2.0"

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
    "MoeBackendSpec",
    "QuantMethodSpec",
    "EngineArgs",
    "PLUGIN_API_VERSION",
    "SpecAlgorithmSpec",
    "hookimpl",
    "hookspec",
    *_LAZY,
]


# Public names of earlier releases that moved or were renamed: they warn (backplane.deprecation).
_deprecated = renamed_names(__name__, {"ServerArgs": "backplane.EngineArgs"}, stacklevel=3)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    return _deprecated(name)
