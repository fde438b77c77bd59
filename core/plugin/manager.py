"""Plugin discovery: the builtin plugins, then every entry point of the group `backplane.plugins`.

Each plugin is loaded and registered on its own. A plugin that fails to import, fails pluggy's
validation, implements a misspelt hook, or raises inside a register hook is recorded with its
error and the rest still load; with strict mode (`--strict-plugins`, BACKPLANE_STRICT_PLUGINS=1)
the first such failure is fatal.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import os
import traceback
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any, Sequence

import pluggy

from backplane.plugin import hookspecs
from backplane.plugin.registry import KINDS, RegistrationError, Registry
from backplane.settings import ENV_PLUGINS, ENV_STRICT_PLUGINS, env_flag

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "backplane.plugins"
BUILTIN_PLUGINS = (
    "backplane.attention.builtin",
    "backplane.lora.builtin",
    "backplane.ops.builtin",
    "backplane.models.builtin",
)
REGISTER_HOOKS = {kind.hook: name for name, kind in KINDS.items()}
# Frames of these files are the loading machinery, not the plugin: error locations skip them.
_MACHINERY_DIRS = tuple(str(Path(m.__file__).parent) + os.sep for m in (pluggy, importlib, hookspecs))


class PluginLoadError(RuntimeError):
    """A plugin failed to load while strict mode is on."""


class PluginHookError(Exception):
    """A plugin's hook implementation does not fit the hook specs; `location` is its file:line."""

    def __init__(self, message: str, location: str | None):
        super().__init__(message)
        self.location = location


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
    for ep in _selected_entry_points(only, plugin_set, strict):
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


def _selected_entry_points(only: list[str] | None, plugin_set: PluginSet, strict: bool) -> list[EntryPoint]:
    """The entry points to load: all, or those `only` names. Those left out are noted in
    `registry.not_loaded`, so that selecting one of their backends says it was filtered out."""
    eps = sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)
    unique = list({ep.name: ep for ep in eps}.values())
    if only is None:
        return unique
    installed = {ep.name for ep in unique}
    if not only:
        _warn(plugin_set, f"{ENV_PLUGINS} is set but empty: no installed plugin loads, only the builtins; "
                          f"unset it to load every installed plugin ({', '.join(sorted(installed)) or 'none'})")
    for name in only:
        if name not in installed:
            message = (f"{ENV_PLUGINS}: no installed plugin is named {name!r}; "
                       f"installed: {', '.join(ep.name for ep in unique) or 'none'}")
            if strict:
                raise PluginLoadError(message + f" (strict mode, {ENV_STRICT_PLUGINS} / --strict-plugins)")
            _warn(plugin_set, message)
    for ep in unique:
        if ep.name not in only:
            plugin_set.registry.not_loaded[ep.name] = f"filtered out by {ENV_PLUGINS}={','.join(only)}"
    return [ep for ep in unique if ep.name in only]


def _warn(plugin_set: PluginSet, message: str) -> None:
    plugin_set.warnings.append(message)
    logger.warning(message)


def _load_one(plugin_set: PluginSet, info: PluginInfo, load, strict: bool) -> None:
    plugin_set.plugins.append(info)
    module = None
    try:
        module = load()
        _check_hooks(plugin_set.pm, module, info)
        plugin_set.pm.register(module, name=info.name)
        info.hooks = sorted(caller.name for caller in plugin_set.pm.get_hookcallers(module) or [])
        _run_register_hooks(plugin_set, info)
    except Exception as exc:  # noqa: BLE001 - a plugin may fail in any way; it is isolated here
        owns_name = module is not None and plugin_set.pm.get_plugin(info.name) is module
        _record_failure(plugin_set, info, exc, strict, owns_name)


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
                                  f"known hooks: {', '.join(known)}", _def_location(fn))
        allowed = list(inspect.signature(getattr(hookspecs, name)).parameters)
        # NOTE: like pluggy, arguments with a default are not hook arguments (never passed).
        extra = [arg for arg, p in inspect.signature(fn).parameters.items()
                 if arg not in allowed and p.default is p.empty and p.kind is not p.VAR_KEYWORD]
        if extra:
            raise PluginHookError(f"plugin {info.name!r}: hook {name} takes unknown argument(s) {', '.join(extra)}; "
                                  f"the spec's arguments: {', '.join(allowed)}", _def_location(fn))


def _one_line(exc: BaseException) -> str:
    """The error on one line: our own errors by their message, others as `Type: message`."""
    if isinstance(exc, (PluginHookError, RegistrationError)):
        return str(exc)
    if isinstance(exc, SyntaxError):  # the position goes into the location
        return f"SyntaxError: {exc.msg}"
    return "; ".join(f"{type(exc).__name__}: {exc}".splitlines())


def _def_location(fn: Any) -> str | None:
    fn = inspect.unwrap(getattr(fn, "__func__", fn))
    code = getattr(fn, "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code else None


def _failure_location(exc: BaseException, info: PluginInfo) -> str | None:
    """file:line in the plugin's own code where loading failed: a SyntaxError's position, a
    misfit hook's definition, or the innermost traceback frame in the plugin's folder (else the
    innermost frame outside pluggy, importlib and backplane's plugin machinery)."""
    if isinstance(exc, PluginHookError):
        return exc.location
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{exc.filename}:{exc.lineno}"
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith(_MACHINERY_DIRS) and not f.filename.startswith("<frozen")]
    root = _plugin_folder(info)
    own = [f for f in frames if root and f.filename.startswith(root)]
    frame = (own or frames or [None])[-1]
    return f"{frame.filename}:{frame.lineno}" if frame else None


def _plugin_folder(info: PluginInfo) -> str | None:
    """The folder of the plugin's module, found without running it again (None if unknown)."""
    try:
        spec = importlib.util.find_spec(info.module.partition(":")[0])
    except Exception:  # noqa: BLE001 - a parent package that fails to import: no folder
        return None
    return str(Path(spec.origin).parent) + os.sep if spec and spec.origin else None


def _run_register_hooks(plugin_set: PluginSet, info: PluginInfo) -> None:
    plugin = plugin_set.pm.get_plugin(info.name)
    for hook_name, kind in REGISTER_HOOKS.items():
        for impl in getattr(plugin_set.pm.hook, hook_name).get_hookimpls():
            if impl.plugin is plugin:
                register = plugin_set.registry.callback(kind, info.name, info.distribution)
                impl.function(**({"register": register} if "register" in impl.argnames else {}))
    info.registered = [f"{kind}:{key}" for kind, key, reg in plugin_set.registry.iter_all()
                       if reg.plugin == info.name]


def _record_failure(plugin_set: PluginSet, info: PluginInfo, exc: Exception, strict: bool, owns_name: bool) -> None:
    """Record why `info` failed; when it got as far as registering (`owns_name`), undo that."""
    info.error = _one_line(exc)
    location = _failure_location(exc, info)
    if location:
        info.error += f" (at {location})"
    info.registered = []
    if owns_name:
        plugin_set.registry.remove_plugin(info.name)
        plugin_set.pm.unregister(name=info.name)
        plugin_set.registry.not_loaded[info.name] = f"failed to load: {info.error}"
    message = f"plugin {info.name!r} ({info.module}) failed to load: {info.error}"
    if strict:
        raise PluginLoadError(message + f" (strict mode, {ENV_STRICT_PLUGINS} / --strict-plugins)") from exc
    _warn(plugin_set, message)
