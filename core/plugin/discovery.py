"""Which entry points of the group `backplane.plugins` load, and in what order.

- backplane's own distribution (the bundled plugins) comes first, then the others by name: a
  third-party plugin that registers a bundled name (`ngram`) is the one refused, and blamed.
- Two distributions declaring the same entry-point name: the first by distribution name loads,
  the other is reported as not loaded, naming both (no silent drop).
- `BACKPLANE_PLUGINS=a,b` keeps only the named ones; those left out are remembered, so a backend
  of theirs is reported as filtered out, not as missing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points

from backplane.settings import ENV_PLUGINS

ENTRY_POINT_GROUP = "backplane.plugins"
CORE_DISTRIBUTION = "backplane-llm"


@dataclass
class Discovered:
    """The entry points to load, in order, and those that will not load with why (name -> reason)."""

    selected: list[EntryPoint]
    clashes: list[tuple[EntryPoint, str]] = field(default_factory=list)
    filtered: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)  # BACKPLANE_PLUGINS names nothing installed has


def dist_name(ep: EntryPoint) -> str | None:
    return ep.dist.name if ep.dist else None


def env_plugin_filter() -> list[str] | None:
    """BACKPLANE_PLUGINS as a list of names; None when unset (load all)."""
    raw = os.environ.get(ENV_PLUGINS)
    if raw is None:
        return None
    return [name.strip() for name in raw.split(",") if name.strip()]


def discover(only: list[str] | None) -> Discovered:
    """The installed entry points, bundled first, deduplicated with clashes named, then filtered."""
    eps = sorted(entry_points(group=ENTRY_POINT_GROUP),
                 key=lambda ep: (dist_name(ep) != CORE_DISTRIBUTION, ep.name, dist_name(ep) or ""))
    found = Discovered(selected=[])
    first: dict[str, EntryPoint] = {}
    for ep in eps:
        if ep.name in first:
            if dist_name(first[ep.name]) != dist_name(ep):  # the same distribution seen twice is one plugin
                found.clashes.append((ep, _clash(first[ep.name], ep)))
            continue
        first[ep.name] = ep
    unique = list(first.values())
    if only is None:
        found.selected = unique
        return found
    _apply_filter(found, unique, only)
    return found


def _clash(kept: EntryPoint, dropped: EntryPoint) -> str:
    return (f"entry point {dropped.name!r} of distribution {dist_name(dropped)!r} ({dropped.value}) has the name of "
            f"entry point {kept.name!r} of distribution {dist_name(kept)!r} ({kept.value}), which loads instead; "
            "uninstall one of the two or rename its entry point")


def _apply_filter(found: Discovered, unique: list[EntryPoint], only: list[str]) -> None:
    installed = [ep.name for ep in unique]
    if not only:
        found.warnings.append(f"{ENV_PLUGINS} is set but empty: no installed plugin loads, only the builtins; "
                              f"unset it to load every installed plugin ({', '.join(sorted(installed)) or 'none'})")
    for name in only:
        if name not in installed:
            found.unknown.append(f"{ENV_PLUGINS}: no installed plugin is named {name!r}; "
                                  f"installed: {', '.join(installed) or 'none'}")
    for ep in unique:
        if ep.name not in only:
            found.filtered[ep.name] = f"filtered out by {ENV_PLUGINS}={','.join(only)}"
    found.selected = [ep for ep in unique if ep.name in only]
