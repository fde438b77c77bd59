"""Calling `backplane_configure` on each plugin, so that a failure names the plugin.

The hook's contract: raise ValueError with a one-line message naming the option to refuse the
settings (the CLI prints it, exit code 2). Anything else a plugin raises there is a bug of that
plugin: it becomes a PluginRuntimeError naming the plugin, the hook and the plugin's file:line,
instead of a traceback with no owner.
"""

from __future__ import annotations

from typing import Any

from backplane.plugin.failures import def_location, failure_location, one_line, with_location
from backplane.plugin.runtime import PluginRuntimeError

HOOK = "backplane_configure"


def configure_plugins(plugin_set: Any, settings: Any) -> None:
    """Call every loaded plugin's configure hook once, in load order, with the final settings."""
    for impl in plugin_set.pm.hook.backplane_configure.get_hookimpls()[::-1]:  # pluggy keeps them last-first
        kwargs = {"settings": settings} if "settings" in impl.argnames else {}
        try:
            impl.function(**kwargs)
        except ValueError as err:  # the documented refusal: its own message, owned by the plugin
            raise ValueError(f"{err} (plugin {impl.plugin_name!r})") from None
        except Exception as exc:  # noqa: BLE001 - any other failure is the plugin's bug, named as such
            location = failure_location(exc, getattr(impl.plugin, "__name__", None)) or def_location(impl.function)
            raise PluginRuntimeError(with_location(
                f"plugin {impl.plugin_name!r}: hook {HOOK} raised {one_line(exc)}", location)) from exc
