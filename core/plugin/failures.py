"""How a plugin's failure is told: one line, and the file:line in the plugin's own code.

Used while plugins load (manager.py) and after, when a factory, `available()` or a hook raises or
returns the wrong thing (runtime.py, selection.py, the configure hook, the custom-op check).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import traceback
from pathlib import Path
from typing import Any

import pluggy

from backplane.plugin import hookspecs
from backplane.plugin.registry import RegistrationError
from backplane.plugin.version import PluginApiError

# Frames of these folders are the loading machinery, not the plugin: error locations skip them.
_MACHINERY_DIRS = tuple(str(Path(m.__file__).parent) + os.sep for m in (pluggy, importlib, hookspecs))


class PluginHookError(Exception):
    """A plugin's hook implementation does not fit the hook specs; `location` is its file:line."""

    def __init__(self, message: str, location: str | None):
        super().__init__(message)
        self.location = location


def one_line(exc: BaseException) -> str:
    """The error on one line: our own errors by their message, others as `Type: message`."""
    if isinstance(exc, (PluginHookError, RegistrationError, PluginApiError)):
        return str(exc)
    if isinstance(exc, SyntaxError):  # the position goes into the location
        return f"SyntaxError: {exc.msg}"
    text = str(exc)
    return "; ".join(f"{type(exc).__name__}: {text}".splitlines()) if text else type(exc).__name__


def def_location(fn: Any) -> str | None:
    """file:line where `fn` (a function, method, partial or callable object) is defined."""
    fn = inspect.unwrap(getattr(fn, "__func__", fn))
    fn = getattr(fn, "func", fn)  # functools.partial
    call = inspect.getattr_static(type(fn), "__call__", None)  # a callable object: its __call__
    code = getattr(fn, "__code__", None) or getattr(call, "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code else None


def failure_location(exc: BaseException, module: str | None = None) -> str | None:
    """file:line in the plugin's own code where `exc` was raised: a SyntaxError's position, a
    misfit hook's definition, or the innermost traceback frame in the folder of `module` (else the
    innermost frame outside pluggy, importlib and backplane's plugin machinery)."""
    if isinstance(exc, PluginHookError):
        return exc.location
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{exc.filename}:{exc.lineno}"
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith(_MACHINERY_DIRS) and not f.filename.startswith("<frozen")]
    root = plugin_folder(module) if module else None
    own = [f for f in frames if root and f.filename.startswith(root)]
    frame = (own or frames or [None])[-1]
    return f"{frame.filename}:{frame.lineno}" if frame else None


def plugin_folder(module: str) -> str | None:
    """The folder of a plugin's module (`pkg.mod` or `pkg.mod:attr`), found without running it again."""
    try:
        spec = importlib.util.find_spec(module.partition(":")[0])
    except Exception:  # noqa: BLE001 - a parent package that fails to import: no folder
        return None
    return str(Path(spec.origin).parent) + os.sep if spec and spec.origin else None


def with_location(message: str, location: str | None) -> str:
    return f"{message} (at {location})" if location else message
