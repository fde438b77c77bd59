"""The plugin API's version, and the check of the version a plugin says it needs.

`PLUGIN_API_VERSION` is "MAJOR.MINOR": the major grows when a public name or hook is removed or
changes meaning (a breaking change), the minor when something is added (a new hook argument, spec
field or public name; a moved name that keeps working with a DeprecationWarning). The first
release was "1.0".

A plugin declares the version it was written against with a module attribute, the way a pytest
plugin declares `pytest_plugins` or a conftest `pytestmark`:

    BACKPLANE_PLUGIN_API = "1.0"

It loads when the core's major is the same and its minor is at least the plugin's. Without the
attribute the plugin is assumed to fit (and `backplane plugins` shows "-").
"""

from __future__ import annotations

import re
from typing import Any

PLUGIN_API_VERSION = "1.1"
PLUGIN_API_ATTRIBUTE = "BACKPLANE_PLUGIN_API"
_VERSION = re.compile(r"(\d+)\.(\d+)")


class PluginApiError(Exception):
    """A plugin needs a plugin API this core does not offer (or declares it malformed)."""


def _parse(version: str) -> tuple[int, int]:
    match = _VERSION.fullmatch(version)
    assert match, f"PLUGIN_API_VERSION {version!r} must be MAJOR.MINOR"
    return int(match.group(1)), int(match.group(2))


def required_api(plugin: Any) -> str | None:
    """The plugin API version `plugin` (a module or object) declares, or None."""
    return getattr(plugin, PLUGIN_API_ATTRIBUTE, None)


def check_api_version(plugin_name: str, needed: Any, core: str = PLUGIN_API_VERSION) -> None:
    """Raise PluginApiError (one line naming the plugin, both versions and what to do) when a
    plugin that needs plugin API `needed` cannot run on a core that offers `core`."""
    if needed is None:
        return
    if not isinstance(needed, str) or not _VERSION.fullmatch(needed):
        raise PluginApiError(f"plugin {plugin_name!r}: {PLUGIN_API_ATTRIBUTE} = {needed!r}; expected a string "
                             f"'MAJOR.MINOR' such as {core!r}")
    major, minor = _parse(needed)
    core_major, core_minor = _parse(core)
    if major != core_major or minor > core_minor:
        raise PluginApiError(
            f"plugin {plugin_name!r} needs backplane plugin API {needed}, this backplane has {core} "
            f"(it runs plugins written for {core_major}.0 to {core}); "
            + ("upgrade backplane" if (major, minor) > (core_major, core_minor)
               else f"install a release of the plugin written for API {core_major}.x")
        )
