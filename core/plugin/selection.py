"""Choosing backends from what is registered: explicit names are validated, `auto` picks the best.

Never a silent fallback: an explicit name that cannot run here is an error listing every reason
and how to fix it; `auto` logs what it chose and why the higher-priority candidates were skipped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from backplane.plugin.registry import AttentionBackendSpec, LoraBackendSpec, Registry

logger = logging.getLogger(__name__)

AUTO = "auto"


class SelectionError(ValueError):
    """The configured backend name is unknown or cannot run with this model, device and mode set."""


@dataclass(frozen=True)
class AttentionRequirements:
    """What the model and settings need from an attention backend."""

    platform: str
    dtype: str
    head_dim: int
    modes: tuple[str, ...]
    sliding_window: bool = False
    logit_softcap: bool = False
    custom_mask: bool = False


@dataclass(frozen=True)
class LoraRequirements:
    platform: str
    dtype: str
    max_rank: int


@dataclass(frozen=True)
class Selection:
    """The chosen spec and a one-line explanation of the choice."""

    spec: AttentionBackendSpec | LoraBackendSpec
    plugin: str
    reason: str


def attention_unusable_reasons(spec: AttentionBackendSpec, req: AttentionRequirements) -> list[str]:
    """Every reason `spec` cannot serve `req` (empty when it can)."""
    reasons = _common_reasons(spec, req.platform, req.dtype)
    if spec.head_dims is not None and req.head_dim not in spec.head_dims:
        reasons.append(f"head dim {req.head_dim} not supported (supports: {_join(spec.head_dims)})")
    missing = [m for m in req.modes if m not in spec.modes]
    if missing:
        reasons.append(f"forward mode {_join(missing)} not supported (supports: {_join(spec.modes)})")
    for flag, label in (("sliding_window", "sliding window"), ("logit_softcap", "logit soft-cap"),
                        ("custom_mask", "custom attention mask")):
        if getattr(req, flag) and not getattr(spec, flag):
            reasons.append(f"{label} not supported, and this model/configuration needs it")
    return reasons


def lora_unusable_reasons(spec: LoraBackendSpec, req: LoraRequirements) -> list[str]:
    reasons = _common_reasons(spec, req.platform, req.dtype)
    if spec.max_rank is not None and req.max_rank > spec.max_rank:
        reasons.append(f"rank {req.max_rank} above its maximum {spec.max_rank}")
    return reasons


def _common_reasons(spec, platform: str, dtype: str) -> list[str]:
    reasons = []
    why = spec.available()
    if why:
        reasons.append(why)
    if platform not in spec.platforms:
        reasons.append(f"platform {platform!r} not supported (supports: {_join(spec.platforms)})")
    if dtype not in spec.dtypes:
        reasons.append(f"dtype {dtype} not supported (supports: {_join(spec.dtypes)})")
    return reasons


def _join(values) -> str:
    return ", ".join(str(v) for v in values)


def select_attention_backend(
    registry: Registry, name: str, req: AttentionRequirements, flag: str = "--attention-backend"
) -> Selection:
    """Resolve `name` (a registered name or `auto`) for `req`; raise SelectionError when impossible."""
    return _select(registry, "attention", name, lambda s: attention_unusable_reasons(s, req), flag, req)


def select_lora_backend(
    registry: Registry, name: str, req: LoraRequirements, flag: str = "--lora-backend"
) -> Selection:
    return _select(registry, "lora", name, lambda s: lora_unusable_reasons(s, req), flag, req)


def _select(registry: Registry, kind: str, name: str, check, flag: str, req) -> Selection:
    specs = registry.specs(kind)
    if name == AUTO:
        return _select_auto(registry, kind, specs, check, flag, req)
    require_known(registry, kind, name, flag)
    reasons = check(specs[name])
    plugin = registry.provenance(kind, name).plugin
    if reasons:
        hint = specs[name].install_hint
        usable = sorted(n for n, s in specs.items() if not check(s))
        raise SelectionError(
            f"{flag} {name} (plugin {plugin!r}) cannot run here: {'; '.join(reasons)}."
            + (f" To fix: {hint}." if hint and specs[name].available() else "")
            + f" Usable here: {_join(usable) or 'none'}"
        )
    return Selection(specs[name], plugin, f"{name} chosen explicitly by {flag}")


def require_known(registry: Registry, kind: str, name: str, flag: str) -> None:
    """Raise SelectionError listing every registered backend when `name` is neither one nor auto."""
    if name != AUTO and name not in registry.specs(kind):
        raise SelectionError(
            f"{flag}: unknown backend {name!r}; registered: {_listing(registry, kind)}, or 'auto'"
        )


def _select_auto(registry: Registry, kind: str, specs: dict, check, flag: str, req) -> Selection:
    skipped = []
    for spec in sorted(specs.values(), key=lambda s: (-s.priority, s.name)):
        reasons = check(spec)
        if not reasons:
            plugin = registry.provenance(kind, spec.name).plugin
            why = f"{spec.name} chosen by {flag} auto (priority {spec.priority}, plugin {plugin!r})"
            if skipped:
                why += "; skipped " + "; ".join(skipped)
            logger.info(why)
            return Selection(spec, plugin, why)
        skipped.append(f"{spec.name}: {', '.join(reasons)}")
    raise SelectionError(
        f"{flag} auto: no registered backend can run {_describe(req)}; "
        + ("; ".join(skipped) if skipped else "none is registered")
    )


def _describe(req) -> str:
    return f"on platform {req.platform!r} with dtype {req.dtype}" + (
        f", head dim {req.head_dim}" if hasattr(req, "head_dim") else ""
    )


def _listing(registry: Registry, kind: str) -> str:
    return ", ".join(
        f"{key} (plugin {reg.plugin!r})" for key, reg in sorted(registry.items[kind].items())
    )
