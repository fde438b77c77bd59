"""Deprecated public names: where each moved, and the module `__getattr__` that keeps the old one
working for a release with a DeprecationWarning naming the new import.

Every moved name is recorded in `MOVED` when its old module is imported; `DEPRECATED_MODULES`
lists the alias modules statically, so `all_moved()` (which imports them) is the whole registry
the public-API snapshot test reads to tell a deprecation from a disappearance.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

CURRENT_RELEASE = "0.2"
REMOVAL_RELEASE = "0.3"


@dataclass(frozen=True)
class Moved:
    """`old` (module.name) now lives at `new` (module.name); deprecated since `since`."""

    old: str
    new: str
    since: str = CURRENT_RELEASE

    def message(self) -> str:
        new_module, _, name = self.new.rpartition(".")
        return (f"{self.old} is deprecated since backplane {self.since} and will be removed in "
                f"{REMOVAL_RELEASE}; import it as `from {new_module} import {name}`")


MOVED: dict[str, Moved] = {}

# The modules that exist only as aliases of moved names (importing one fills MOVED with its names).
DEPRECATED_MODULES = (
    "backplane.batch",
    "backplane.memory",
    "backplane.executor.batch",
    "backplane.executor.memory",
    "backplane.executor.protocols",
    "backplane.attention.base",
    "backplane.lora.base",
    "backplane.lora.batch_info",
    "backplane.engine.batch_builder",
    "backplane.engine.prefix_cache",
    "backplane.engine.request",
    "backplane.engine.sampling_params",
    "backplane.engine.scheduler",
    "backplane.engine.stream",
    "backplane.engine.decode_state",
    "backplane.engine.overlap",
    "backplane.engine.radix",
    "backplane.engine.sampling_state",
    "backplane.engine.stopping",
    "backplane.engine.detokenize",
    "backplane.engine.tokenizer",
)


def moved_names(old_module: str, new_module: str, names: Iterable[str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `old_module`, whose `names` moved to `new_module`: each access
    warns once per call site (DeprecationWarning, attributed to the importer) and returns the new
    object; any other name raises AttributeError as usual. A single name may be given as a string."""
    names = (names,) if isinstance(names, str) else tuple(names)
    return renamed_names(old_module, {name: f"{new_module}.{name}" for name in names})


def renamed_names(old_module: str, table: dict[str, str], stacklevel: int = 2) -> Callable[[str], Any]:
    """Like `moved_names`, for names that also changed their name: `table` maps each old name to
    its new home `module.NewName` (`{"ServerArgs": "backplane.EngineArgs"}`). `stacklevel`: 3 when
    the returned function is called from the module's own `__getattr__` rather than being it."""
    moved = {name: Moved(f"{old_module}.{name}", new) for name, new in table.items()}
    MOVED.update({m.old: m for m in moved.values()})

    def __getattr__(name: str) -> Any:
        entry = moved.get(name)
        if entry is None:
            raise AttributeError(f"module {old_module!r} has no attribute {name!r}")
        warnings.warn(entry.message(), DeprecationWarning, stacklevel=stacklevel)
        new_module, _, new_name = entry.new.rpartition(".")
        return getattr(importlib.import_module(new_module), new_name)

    return __getattr__


def all_moved() -> dict[str, Moved]:
    """Every deprecated name: `MOVED` after importing each of `DEPRECATED_MODULES` (and `backplane`)."""
    for module in ("backplane", *DEPRECATED_MODULES):
        importlib.import_module(module)
    return dict(MOVED)
