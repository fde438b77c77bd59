"""A throwaway plugin object for tests: its attributes are hook implementations."""

from __future__ import annotations

import types

from backplane import hookimpl


def make_plugin(name: str, api: str | None = None, **hooks) -> types.SimpleNamespace:
    """A plugin named `name` implementing `hooks` (hook name -> function); `api`: the plugin API
    version it declares (BACKPLANE_PLUGIN_API), if any."""
    plugin = types.SimpleNamespace(__name__=name, **({"BACKPLANE_PLUGIN_API": api} if api is not None else {}))
    for hook, fn in hooks.items():
        fn.__name__ = hook
        setattr(plugin, hook, hookimpl(fn))
    return plugin
