"""Deprecated public names: where each moved, and the module `__getattr__` that keeps the old one
working for a release with a DeprecationWarning naming the new import.

Every moved name is recorded in `MOVED` when its old module is imported, and listed statically in
`DEPRECATED_MODULES`, so the public-API snapshot test can tell a deprecation from a disappearance.
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


def moved_names(old_module: str, new_module: str, names: Iterable[str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `old_module`, whose `names` moved to `new_module`: each access
    warns once per call site (DeprecationWarning, attributed to the importer) and returns the new
    object; any other name raises AttributeError as usual."""
    table = {name: Moved(f"{old_module}.{name}", f"{new_module}.{name}") for name in names}
    MOVED.update({m.old: m for m in table.values()})

    def __getattr__(name: str) -> Any:
        moved = table.get(name)
        if moved is None:
            raise AttributeError(f"module {old_module!r} has no attribute {name!r}")
        warnings.warn(moved.message(), DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(new_module), name)

    return __getattr__
