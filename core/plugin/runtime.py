"""Building what a plugin registered, after discovery, with its failures told in one line.

A factory runs long after its plugin loaded: when the model runner builds the attention backend,
the LoRA manager its backend, the engine the speculative worker, the loader the model. There it may
raise (its heavy module fails to import) or return the wrong object. `build` turns both into a
PluginRuntimeError naming the plugin, the kind, the name and the plugin's file:line; the CLI prints
it as one line with exit code 2. Under `auto`, `build_first` tries the next usable candidate and
logs why:

    backend, choice = build_first(choice, setup.backend_context, kind="attention")  # executor.attention_setup
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import replace
from typing import Any, Callable

from backplane.plugin.failures import def_location, failure_location, one_line, with_location
from backplane.plugin.registry import KINDS

logger = logging.getLogger(__name__)

# What each kind's factory must return: (module, class name), imported only when checked.
PRODUCTS = {
    "attention": ("backplane.contracts.attention", "AttentionBackend"),
    "lora": ("backplane.contracts.lora", "LoraBackend"),
    "spec": ("backplane.speculative.worker", "SpecWorker"),
    "model": ("torch.nn", "Module"),
    "quant": ("backplane.contracts.quant", "QuantConfig"),
    "moe": ("backplane.contracts.moe", "MoeBackend"),
}


class PluginRuntimeError(RuntimeError):
    """A plugin's factory, hook or op failed after discovery; the message is one line naming the
    plugin, what failed and where (file:line)."""


def build(choice: Any, *args: Any, kind: str) -> Any:
    """`choice.spec.factory(*args)` (a Selection), or `choice.item.factory(*args)` (a Registered),
    checked: a raise or a product of the wrong type becomes a PluginRuntimeError."""
    spec, plugin = _spec_and_plugin(choice)
    what = f"plugin {plugin!r}: {KINDS[kind].label} {KINDS[kind].key(spec)!r}"
    try:
        product = spec.factory(*args)
    except ValueError as exc:  # the documented refusal of bad settings: the user's error, said first
        raise PluginRuntimeError(f"{' '.join(str(exc).split()) or one_line(exc)} ({what})") from exc
    except Exception as exc:  # noqa: BLE001 - the plugin's factory may fail in any way
        location = failure_location(exc, getattr(spec.factory, "__module__", None))
        raise PluginRuntimeError(with_location(f"{what}: factory raised {one_line(exc)}", location)) from exc
    expected = _product_type(kind)
    if expected is not None and not isinstance(product, expected):
        raise PluginRuntimeError(with_location(
            f"{what}: factory returned {type(product).__name__}, expected a {expected.__name__}",
            def_location(spec.factory)))
    return product


def build_first(choice: Any, context_for: Callable[[Any], Any], *, kind: str) -> tuple[Any, Any]:
    """Build `choice` (a Selection) with `context_for(choice)`; when that fails and the choice was
    `auto`'s, log the reason and build the next usable candidate (`choice.alternatives`), in order.
    Returns (product, the Selection actually built). An explicit choice is never replaced."""
    failures: list[str] = []
    while True:
        try:
            return build(choice, context_for(choice), kind=kind), choice
        except PluginRuntimeError as err:
            if not choice.alternatives:
                if failures:
                    raise PluginRuntimeError(f"{err}; tried before it: {'; '.join(failures)}") from err
                raise
            failures.append(str(err))
            choice = _next(choice, str(err))
            logger.warning("%s; auto takes %s (plugin %r) instead", err, choice.spec.name, choice.plugin)


def _next(choice: Any, why: str) -> Any:
    following = choice.alternatives[0]
    return replace(choice, spec=following.item, plugin=following.plugin, alternatives=choice.alternatives[1:],
                   reason=f"{following.item.name} chosen by auto after {choice.spec.name} failed to build: {why}")


def _spec_and_plugin(choice: Any) -> tuple[Any, str]:
    if hasattr(choice, "spec") and hasattr(choice, "plugin"):
        return choice.spec, choice.plugin
    if hasattr(choice, "item") and hasattr(choice, "plugin"):
        return choice.item, choice.plugin
    raise TypeError(f"build: expected a Selection or a Registered, got {type(choice).__name__}")


def _product_type(kind: str) -> type | None:
    if kind not in PRODUCTS:
        return None
    module, name = PRODUCTS[kind]
    return getattr(importlib.import_module(module), name)
