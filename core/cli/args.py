"""Builds argparse flags from EngineArgs and the plugin option groups (the CLI is made from settings).

Parsing is two-phase: the core flags that decide plugin loading (`--strict-plugins`) are read
first, plugins are loaded, then the full parser (with every `--<group>.<option>`) is built.
`preflight` then runs the checks that need the model's config but nothing built (the heads over
--tp-size, the model's memory) and sets the CPU threads, before any worker or engine starts.
"""

from __future__ import annotations

import argparse
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel

from backplane.settings import EngineArgs, env_name, flag_name

GROUP_SEP = "."


def add_model_flags(parser: argparse.ArgumentParser, model: type[BaseModel], group: str | None = None,
                    skip: tuple[str, ...] = ("plugin_options",), title: str | None = None) -> None:
    """Add one flag per field of `model`; values stay strings/lists for pydantic to validate."""
    section = parser.add_argument_group(title or (f"{group} (plugin options)" if group else "engine arguments"))
    for name, info in model.model_fields.items():
        if name in skip:
            continue
        flag = f"--{group}{GROUP_SEP}{name.replace('_', '-')}" if group else flag_name(name)
        dest = f"{group}{GROUP_SEP}{name}" if group else name
        kwargs = _argparse_kwargs(info.annotation)
        default_text = "" if info.default is None or callable(info.default_factory) else f" (default: {info.default})"
        help_text = f"{info.description or ''}{default_text} [env {env_name(name, group)}]"
        section.add_argument(flag, dest=dest, default=argparse.SUPPRESS, help=help_text, **kwargs)


def _argparse_kwargs(annotation: Any) -> dict[str, Any]:
    inner = _strip_optional(annotation)
    if inner is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(inner) is list:
        return {"nargs": "+", "metavar": "VALUE"}
    if typing.get_origin(inner) is Literal:
        return {"metavar": "{" + ",".join(str(a) for a in typing.get_args(inner)) + "}"}
    return {"metavar": getattr(inner, "__name__", "VALUE").upper()}


def _strip_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) is typing.Annotated:
        return _strip_optional(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _strip_optional(args[0])
    return annotation


def split_namespace(ns: argparse.Namespace, groups: dict[str, type]) -> tuple[dict, dict[str, dict]]:
    """Separate core values from plugin-group values in a parsed namespace."""
    core, grouped = {}, {}
    for key, value in vars(ns).items():
        if GROUP_SEP in key:
            group, _, field = key.partition(GROUP_SEP)
            grouped.setdefault(group, {})[field] = value
        elif key in EngineArgs.model_fields:
            core[key] = value
    return core, grouped


def prescan_strict(argv: list[str]) -> bool | None:
    """Phase one: `--strict-plugins` must be known before plugins load."""
    if "--strict-plugins" in argv:
        return True
    if "--no-strict-plugins" in argv:
        return False
    return None


def preflight(args: EngineArgs) -> str:
    """Refuse, in one line, what the model config already rules out: a --tp-size its heads do not
    divide (before any worker starts) and, on CPU, a model larger than the free memory. Then set
    torch's CPU threads; returns a line saying how many and why."""

    from backplane.config import apply_cpu_threads
    from backplane.executor.model_runner import available_memory, resolve_device, resolve_dtype, resolve_model_source
    from backplane.models.config_check import check_model_memory, check_tensor_parallel

    config = resolve_model_source(args).hf_config
    check_tensor_parallel(config, args.tp_size)
    device = resolve_device(args)
    if device.type != "cpu":  # CUDA's free memory is read by the engine, not by this process
        return f"device {device.type}"
    check_model_memory(config, resolve_dtype(args, device).itemsize, available_memory(device), "cpu", args.tp_size)
    return apply_cpu_threads(args, config)
