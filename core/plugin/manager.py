"""Plugin discovery: the builtin plugins, then every entry point of the group `backplane.plugins`.

Each plugin is loaded and registered on its own. A plugin that fails to import, fails pluggy's
validation, implements a misspelt hook, or raises inside a register hook is recorded with its
error and the rest still load; with strict mode (`--strict-plugins`, BACKPLANE_STRICT_PLUGINS=1)
the first such failure is fatal.
"""

from __future__ import annotations

import importlib
import logging
import os
import traceback
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Sequence

import pluggy

from backplane.plugin import hookspecs
from backplane.plugin.registry import Registry
from backplane.settings import ENV_PLUGINS, ENV_STRICT_PLUGINS, env_flag

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "backplane.plugins"
BUILTIN_PLUGINS = (
    "backplane.attention.builtin",
    "backplane.lora.builtin",
    "backplane.ops.builtin",
    "backplane.models.builtin",
)
REGISTER_HOOKS = {
    "backplane_register_attention_backends": "attention",
    "backplane_register_lora_backends": "lora",
    "backplane_register_custom_ops": "custom_op",
    "backplane_register_spec_algorithms": "spec",
    "backplane_register_models": "model",
    "backplane_register_settings": "settings",
}


class PluginLoadError(RuntimeError):
    """A plugin failed to load while strict mode is on."""


@dataclass
class PluginInfo:
    """One plugin as `backplane plugins` lists it."""

    name: str
    module: str
    builtin: bool
    distribution: str | None = None
    version: str | None = None
    hooks: list[str] = field(default_factory=list)
    registered: list[str] = field(default_factory=list)
    error: str | None = None


@dataclass
class PluginSet:
    """The loaded plugins: the pluggy manager, what they registered, and how loading went."""

    pm: pluggy.PluginManager
    registry: Registry
    plugins: list[PluginInfo]
    warnings: list[str]

    def configure(self, settings: Any) -> None:
        """Call the historic `backplane_configure` hook once the settings are final."""
        self.pm.hook.backplane_configure.call_historic(kwargs={"settings": settings})

    def settings_groups(self) -> dict[str, type]:
        return {name: reg.item.model for name, reg in self.registry.items["settings"].items()}


def new_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    return pm


def load_plugins(
    strict: bool | None = None, only: list[str] | None = None, extra: Sequence[Any] = ()
) -> PluginSet:
    """Load builtins, then entry points, then `extra` plugin objects (modules or instances).

    `only` (default: BACKPLANE_PLUGINS) limits the entry points; `extra` is how a program or a
    test registers a plugin without packaging it (`Engine(..., plugins=[my_plugin])`).
    """
    strict = env_flag(ENV_STRICT_PLUGINS) if strict is None else strict
    only = _env_plugin_filter() if only is None else only
    plugin_set = PluginSet(new_plugin_manager(), Registry(), [], [])
    for module_name in BUILTIN_PLUGINS:
        info = PluginInfo(name=module_name.removeprefix("backplane."), module=module_name, builtin=True)
        _load_one(plugin_set, info, lambda m=module_name: importlib.import_module(m), strict)
    for ep in _selected_entry_points(only, plugin_set.warnings):
        info = PluginInfo(
            name=ep.name, module=ep.value, builtin=False,
            distribution=ep.dist.name if ep.dist else None,
            version=ep.dist.version if ep.dist else None,
        )
        _load_one(plugin_set, info, ep.load, strict)
    for obj in extra:
        name = getattr(obj, "__name__", None) or type(obj).__name__
        info = PluginInfo(name=name, module=getattr(obj, "__module__", name) or name, builtin=False)
        _load_one(plugin_set, info, lambda o=obj: o, strict)
    plugin_set.pm.check_pending()
    return plugin_set


def _env_plugin_filter() -> list[str] | None:
    raw = os.environ.get(ENV_PLUGINS)
    if raw is None:
        return None
    return [name.strip() for name in raw.split(",") if name.strip()]


def _selected_entry_points(only: list[str] | None, warnings: list[str]) -> list[EntryPoint]:
    eps = sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)
    unique = list({ep.name: ep for ep in eps}.values())
    if only is None:
        return unique
    for name in only:
        if name not in {ep.name for ep in unique}:
            message = (f"{ENV_PLUGINS}: no installed plugin is named {name!r}; "
                       f"installed: {', '.join(ep.name for ep in unique) or 'none'}")
            warnings.append(message)
            logger.warning(message)
    return [ep for ep in unique if ep.name in only]


def _load_one(plugin_set: PluginSet, info: PluginInfo, load, strict: bool) -> None:
    plugin_set.plugins.append(info)
    try:
        module = load()
        plugin_set.pm.register(module, name=info.name)
        info.hooks = sorted(impl_name for impl_name in _hook_names(plugin_set.pm, module))
        _check_hook_names(plugin_set.pm, info)
        _run_register_hooks(plugin_set, info)
    except Exception as exc:  # noqa: BLE001 - a plugin may fail in any way; it is isolated here
        _record_failure(plugin_set, info, exc, strict)


def _hook_names(pm: pluggy.PluginManager, module: Any) -> list[str]:
    return [caller.name for caller in pm.get_hookcallers(module) or []] + _unknown_hooks(pm, module)


def _unknown_hooks(pm: pluggy.PluginManager, module: Any) -> list[str]:
    return [name for name in dir(module)
            if pm.parse_hookimpl_opts(module, name) is not None and not hasattr(hookspecs, name)]


def _check_hook_names(pm: pluggy.PluginManager, info: PluginInfo) -> None:
    plugin = pm.get_plugin(info.name)
    unknown = _unknown_hooks(pm, plugin)
    if unknown:
        known = ", ".join(sorted(n for n in dir(hookspecs) if n.startswith("backplane_")))
        raise pluggy.PluginValidationError(
            plugin, f"plugin {info.name!r} implements unknown hook {unknown[0]!r}; known hooks: {known}"
        )


def _run_register_hooks(plugin_set: PluginSet, info: PluginInfo) -> None:
    plugin = plugin_set.pm.get_plugin(info.name)
    for hook_name, kind in REGISTER_HOOKS.items():
        for impl in getattr(plugin_set.pm.hook, hook_name).get_hookimpls():
            if impl.plugin is plugin:
                register = plugin_set.registry.callback(kind, info.name, info.distribution)
                impl.function(**({"register": register} if "register" in impl.argnames else {}))
    info.registered = [f"{kind}:{key}" for kind, key, reg in plugin_set.registry.iter_all()
                       if reg.plugin == info.name]


def _record_failure(plugin_set: PluginSet, info: PluginInfo, exc: Exception, strict: bool) -> None:
    detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    info.error = detail.splitlines()[-1] if detail else type(exc).__name__
    info.registered = []
    plugin_set.registry.remove_plugin(info.name)
    plugin = plugin_set.pm.get_plugin(info.name)
    if plugin is not None:
        plugin_set.pm.unregister(plugin)
    message = f"plugin {info.name!r} ({info.module}) failed to load: {info.error}"
    if strict:
        raise PluginLoadError(message + f" (strict mode, {ENV_STRICT_PLUGINS} / --strict-plugins)") from exc
    plugin_set.warnings.append(message)
    logger.warning(message)
