"""Plugin discovery: the builtin plugins, then every entry point of the group `backplane.plugins`.

Each plugin is loaded and registered on its own. A plugin that fails to import, fails pluggy's
validation, implements a misspelt hook, or raises inside a register hook is recorded with its
error and the rest still load; with strict mode (`--strict-plugins`, BACKPLANE_STRICT_PLUGINS=1)
the first such failure is fatal.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import pluggy

from backplane.plugin import hookspecs
from backplane.plugin.discovery import CORE_DISTRIBUTION, ENTRY_POINT_GROUP, discover, dist_name, env_plugin_filter
from backplane.plugin.failures import PluginHookError, def_location, failure_location, one_line, with_location
from backplane.plugin.interrupts import InterruptWatch, watch_interrupts
from backplane.plugin.registry import KINDS, Registry
from backplane.plugin.version import PluginApiError, check_api_version, required_api
from backplane.settings import ENV_STRICT_PLUGINS, env_flag

logger = logging.getLogger(__name__)

__all__ = ["CORE_DISTRIBUTION", "ENTRY_POINT_GROUP", "PluginHookError", "PluginInfo", "PluginLoadError",
           "PluginSet", "load_plugins", "new_plugin_manager"]

BUILTIN_PLUGINS = (
    "backplane.attention.builtin",
    "backplane.lora.builtin",
    "backplane.moe.builtin",
    "backplane.ops.builtin",
    "backplane.models.builtin",
)
REGISTER_HOOKS = {kind.hook: name for name, kind in KINDS.items()}
SLOW_IMPORT_S = 1.0  # a plugin slower than this to load is named in a warning


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
    api: str | None = None  # the plugin API version it declares (BACKPLANE_PLUGIN_API)
    load_seconds: float = 0.0  # import and register hooks


@dataclass
class PluginSet:
    """The loaded plugins: the pluggy manager, what they registered, and how loading went."""

    pm: pluggy.PluginManager
    registry: Registry
    plugins: list[PluginInfo]
    warnings: list[str]

    def configure(self, settings: Any) -> None:
        """Call every plugin's `backplane_configure` once the settings are final (see configure.py)."""
        from backplane.plugin.configure import configure_plugins

        configure_plugins(self, settings)

    def settings_groups(self) -> dict[str, type]:
        return {name: reg.item.model for name, reg in self.registry.items["settings"].items()}


def new_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    return pm


def load_plugins(
    strict: bool | None = None, only: list[str] | None = None, extra: Sequence[Any] = ()
) -> PluginSet:
    """Load builtins, then entry points (backplane's own first), then `extra` plugin objects.

    `only` (default: BACKPLANE_PLUGINS) limits the entry points; `extra` is how a program or a
    test registers a plugin without packaging it (`Engine(..., plugins=[my_plugin])`).
    """
    strict = env_flag(ENV_STRICT_PLUGINS) if strict is None else strict
    found = discover(env_plugin_filter() if only is None else only)
    plugin_set = PluginSet(new_plugin_manager(), Registry(), [], [])
    for message in found.unknown:
        _fail_or_warn(plugin_set, message, strict)
    for message in found.warnings:
        _warn(plugin_set, message)
    plugin_set.registry.not_loaded.update(found.filtered)
    with watch_interrupts() as watch:
        for module_name in BUILTIN_PLUGINS:
            info = PluginInfo(name=module_name.removeprefix("backplane."), module=module_name, builtin=True)
            _load_one(plugin_set, info, lambda m=module_name: importlib.import_module(m), strict, watch)
        for ep in found.selected:
            info = PluginInfo(name=ep.name, module=ep.value, builtin=False, distribution=dist_name(ep),
                              version=ep.dist.version if ep.dist else None)
            _load_one(plugin_set, info, ep.load, strict, watch)
        for obj in extra:
            name = getattr(obj, "__name__", None) or type(obj).__name__
            info = PluginInfo(name=name, module=getattr(obj, "__module__", name) or name, builtin=False)
            _load_one(plugin_set, info, lambda o=obj: o, strict, watch)
    for ep, message in found.clashes:
        plugin_set.plugins.append(PluginInfo(name=ep.name, module=ep.value, builtin=False, distribution=dist_name(ep),
                                             version=ep.dist.version if ep.dist else None, error=message))
        _fail_or_warn(plugin_set, f"plugin {ep.name!r} not loaded: {message}", strict)
    plugin_set.pm.check_pending()
    return plugin_set


def _fail_or_warn(plugin_set: PluginSet, message: str, strict: bool) -> None:
    if strict:
        raise PluginLoadError(message + f" (strict mode, {ENV_STRICT_PLUGINS} / --strict-plugins)")
    _warn(plugin_set, message)


def _warn(plugin_set: PluginSet, message: str) -> None:
    plugin_set.warnings.append(message)
    logger.warning(message)


def _load_one(plugin_set: PluginSet, info: PluginInfo, load, strict: bool, watch: InterruptWatch) -> None:
    """Import and register one plugin; any failure (SystemExit and a plugin's own KeyboardInterrupt
    included, see interrupts.py) is recorded on `info`, and the others still load."""
    plugin_set.plugins.append(info)
    module = None
    started = time.perf_counter()
    try:
        module = load()
        info.api = required_api(module)
        check_api_version(info.name, info.api)
        _check_hooks(plugin_set.pm, module, info)
        plugin_set.pm.register(module, name=info.name)
        info.hooks = sorted(caller.name for caller in plugin_set.pm.get_hookcallers(module) or [])
        _run_register_hooks(plugin_set, info)
    except BaseException as exc:  # noqa: BLE001 - a plugin may fail in any way; it is isolated here
        if watch.is_real(exc):
            raise
        owns_name = module is not None and plugin_set.pm.get_plugin(info.name) is module
        _record_failure(plugin_set, info, exc, strict, owns_name)
    finally:
        info.load_seconds = time.perf_counter() - started
        _note_time(plugin_set, info)


def _note_time(plugin_set: PluginSet, info: PluginInfo) -> None:
    logger.debug("plugin %r (%s) loaded in %.3f s", info.name, info.module, info.load_seconds)
    if info.load_seconds > SLOW_IMPORT_S and not info.builtin:  # the builtins import torch for everyone
        _warn(plugin_set, f"plugin {info.name!r} ({info.module}) took {info.load_seconds:.1f} s to load, which every "
                          "backplane command (and --help) waits for; it should import heavy modules inside its "
                          "factories (or leave it out with BACKPLANE_PLUGINS)")
def _check_hooks(pm: pluggy.PluginManager, module: Any, info: PluginInfo) -> None:
    """Before pluggy sees the plugin: its name is free, every hook it implements exists and takes
    only arguments the spec knows. Errors name the implementing function's file and line."""
    taken = pm.get_plugin(info.name)
    if taken is not None or pm.is_registered(module):
        other = pm.get_name(module) if taken is None else getattr(taken, "__name__", repr(taken))
        raise PluginHookError(f"plugin name {info.name!r} is already taken (by {other}); "
                              "give the entry point or plugin object another name", None)
    known = sorted(n for n in dir(hookspecs) if n.startswith("backplane_"))
    for name in dir(module):
        if pm.parse_hookimpl_opts(module, name) is None:
            continue
        fn = getattr(module, name)
        if name not in known:
            raise PluginHookError(f"plugin {info.name!r} implements unknown hook {name!r}; "
                                  f"known hooks: {', '.join(known)}", def_location(fn))
        allowed = list(inspect.signature(getattr(hookspecs, name)).parameters)
        # NOTE: like pluggy, arguments with a default are not hook arguments (never passed).
        extra = [arg for arg, p in inspect.signature(fn).parameters.items()
                 if arg not in allowed and p.default is p.empty and p.kind is not p.VAR_KEYWORD]
        if extra:
            raise PluginHookError(f"plugin {info.name!r}: hook {name} takes unknown argument(s) {', '.join(extra)}; "
                                  f"the spec's arguments: {', '.join(allowed)}", def_location(fn))


def _run_register_hooks(plugin_set: PluginSet, info: PluginInfo) -> None:
    plugin = plugin_set.pm.get_plugin(info.name)
    for hook_name, kind in REGISTER_HOOKS.items():
        for impl in getattr(plugin_set.pm.hook, hook_name).get_hookimpls():
            if impl.plugin is plugin:
                register = plugin_set.registry.callback(kind, info.name, info.distribution)
                impl.function(**({"register": register} if "register" in impl.argnames else {}))
    info.registered = [f"{kind}:{key}" for kind, key, reg in plugin_set.registry.iter_all()
                       if reg.plugin == info.name]


def _record_failure(plugin_set: PluginSet, info: PluginInfo, exc: BaseException, strict: bool,
                    owns_name: bool) -> None:
    """Record why `info` failed; when it got as far as registering (`owns_name`), undo that."""
    info.error = one_line(exc) if not isinstance(exc, SystemExit) else f"SystemExit({exc.code!r}): it called sys.exit()"
    if not isinstance(exc, PluginApiError):  # an API mismatch is about the plugin, not a line of it
        info.error = with_location(info.error, failure_location(exc, info.module))
    info.registered = []
    if owns_name:
        plugin_set.registry.remove_plugin(info.name)
        plugin_set.pm.unregister(name=info.name)
    plugin_set.registry.not_loaded[info.name] = f"failed to load: {info.error}"
    message = f"plugin {info.name!r} ({info.module}) failed to load: {info.error}"
    if strict:
        raise PluginLoadError(message + f" (strict mode, {ENV_STRICT_PLUGINS} / --strict-plugins)") from exc
    _warn(plugin_set, message)
