"""Choosing backends from what is registered: explicit names are validated, `auto` picks the best.

Never a silent fallback: an explicit name that cannot run here is an error listing every reason
and how to fix it; `auto` logs what it chose and why the higher-priority candidates were skipped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from backplane.plugin.failures import def_location, one_line, with_location
from backplane.plugin.registry import KINDS, AttentionBackendSpec, LoraBackendSpec, Registered, Registry

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
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype: "auto" (the model's dtype) or one a backend must declare


@dataclass(frozen=True)
class LoraRequirements:
    platform: str
    dtype: str
    max_rank: int


@dataclass(frozen=True)
class QuantRequirements:
    """What the checkpoint and settings need from a quantization method.

    checkpoint_format: quantization_config's `quant_method` ("compressed-tensors", "fp8"), or None
    for an unquantized checkpoint. lora, tensor_parallel, graphs, compile: the run uses them.
    """

    platform: str
    dtype: str
    checkpoint_format: str | None
    lora: bool = False
    tensor_parallel: bool = False
    graphs: bool = False
    compile: bool = False


@dataclass(frozen=True)
class MoeRequirements:
    """What a mixture-of-experts model and the run need from a MoE backend.

    num_experts, top_k: the model's experts per layer and experts per token. quant: the run's
    quantization method name (--quantization as selected), None for unquantized weights. graphs,
    compile: the run captures CUDA graphs / runs under torch.compile.
    """

    platform: str
    dtype: str
    num_experts: int
    top_k: int
    quant: str | None = None
    graphs: bool = False
    compile: bool = False


@dataclass(frozen=True)
class Selection:
    """The chosen spec and a one-line explanation of the choice.

    alternatives: under `auto`, the other usable candidates in the order `auto` ranks them, for
    `backplane.plugin.runtime.build_first` when the chosen one fails to build; empty when explicit.
    """

    spec: AttentionBackendSpec | LoraBackendSpec
    plugin: str
    reason: str
    alternatives: tuple[Registered, ...] = ()


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
    if req.kv_cache_dtype != "auto" and req.kv_cache_dtype not in spec.kv_cache_dtypes:
        served = ", ".join(("the model dtype", *spec.kv_cache_dtypes))
        reasons.append(f"KV cache dtype {req.kv_cache_dtype} not served (serves: {served}. Fix: --kv-cache-dtype "
                       f"auto, or a backend declaring kv_cache_dtypes {req.kv_cache_dtype})")
    return reasons


def lora_unusable_reasons(spec: LoraBackendSpec, req: LoraRequirements) -> list[str]:
    reasons = _common_reasons(spec, req.platform, req.dtype)
    if spec.max_rank is not None and req.max_rank > spec.max_rank:
        reasons.append(f"rank {req.max_rank} above its maximum {spec.max_rank}")
    return reasons


def quant_unusable_reasons(spec: Any, req: QuantRequirements) -> list[str]:
    """Every reason quantization method `spec` cannot load this checkpoint in this run, each with its fix."""
    reasons = _common_reasons(spec, req.platform, req.dtype)
    fmt = req.checkpoint_format
    if fmt is not None and fmt not in spec.checkpoint_formats:
        reasons.append(f"cannot load quant_method {fmt!r} checkpoints (loads: {_join(spec.checkpoint_formats) or 'none'})")
    if fmt is None and not spec.supports_online:
        reasons.append("the checkpoint has no quantization_config and this method does not quantize online "
                       f"(loads: {_join(spec.checkpoint_formats) or 'none'}; fix: a checkpoint in one of those formats)")
    for needed, declared, label, fix in (
            (req.lora, spec.supports_lora, "LoRA", "drop --lora-paths"),
            (req.tensor_parallel, spec.supports_tp, "tensor parallelism", "--tp-size 1"),
            (req.graphs, spec.supports_graph, "CUDA graphs", "--disable-cuda-graph"),
            (req.compile, spec.supports_compile, "torch.compile", "drop --enable-torch-compile")):
        if needed and not declared:
            reasons.append(f"{label} not supported (fix: {fix})")
    return reasons


# NOTE: the bundled moe_triton plugin's backend captures graphs; the core's torch_native does not
# (its per-expert token counts decide tensor shapes), so a graph run names both ways out.
MOE_GRAPH_FIX = "--disable-cuda-graph, or a MoE backend with supports_graph such as triton of the bundled moe_triton plugin"


def moe_unusable_reasons(spec: Any, req: MoeRequirements) -> list[str]:
    """Every reason MoE backend `spec` cannot serve this model in this run, each with its fix."""
    reasons = _common_reasons(spec, req.platform, req.dtype)
    if spec.max_top_k is not None and req.top_k > spec.max_top_k:
        reasons.append(f"top-k {req.top_k} above its maximum {spec.max_top_k}")
    if spec.max_experts is not None and req.num_experts > spec.max_experts:
        reasons.append(f"{req.num_experts} experts above its maximum {spec.max_experts}")
    if req.quant is not None and req.quant not in spec.quant_methods:
        reasons.append(f"expert weights quantized by {req.quant!r} not supported (supports: "
                       f"{_join(spec.quant_methods) or 'unquantized only'}; fix: a MoE backend declaring "
                       f"quant_methods {req.quant}, or an unquantized run)")
    for needed, declared, label, fix in (
            (req.graphs, spec.supports_graph, "CUDA graphs", MOE_GRAPH_FIX),
            (req.compile, spec.supports_compile, "torch.compile", "drop --enable-torch-compile")):
        if needed and not declared:
            reasons.append(f"{label} not supported (fix: {fix})")
    return reasons


def availability_reasons(spec, platform: str) -> list[str]:
    """Why `spec` cannot run on `platform` whatever the model: its `available()` reason (a missing
    dependency) and an unsupported platform. Selection and `backplane plugins` both use this."""
    reasons = []
    why = available_reason(spec)
    if why:
        reasons.append(why)
    if platform not in spec.platforms:
        reasons.append(f"platform {platform!r} not supported (supports: {_join(spec.platforms)})")
    return reasons


def available_reason(spec: Any) -> str | None:
    """`spec.available()`: None when usable, else the reason. A plugin whose `available()` raises or
    returns anything but None or a non-empty string (False, say) is unusable, and the reason says so
    with the function's file:line: `False` must never count as usable."""
    try:
        why = spec.available()
    except Exception as exc:  # noqa: BLE001 - a plugin's check may fail in any way
        return with_location(f"available() raised {one_line(exc)}", def_location(spec.available))
    if why is None or (isinstance(why, str) and why.strip()):
        return why
    return with_location(f"available() returned {why!r}; expected None (usable) or a reason string",
                         def_location(spec.available))


def install_hint_applies(spec: Any, platform: str) -> bool:
    """Whether `spec.install_hint` is the fix: a dependency is missing on a platform it supports (on a
    CPU machine a CUDA-only backend's hint would send the user to install what is already there)."""
    return bool(spec.install_hint) and platform in spec.platforms and available_reason(spec) is not None


def _common_reasons(spec, platform: str, dtype: str) -> list[str]:
    reasons = availability_reasons(spec, platform)
    if dtype not in spec.dtypes:
        reasons.append(f"dtype {dtype} not supported (supports: {_join(spec.dtypes)})")
    return reasons


def _join(values) -> str:
    return ", ".join(str(v) for v in values)


def select_attention_backend(
    registry: Registry, name: str, req: AttentionRequirements, flag: str = "--attention-backend"
) -> Selection:
    """Resolve `name` (NAME, NAME@PLUGIN or `auto`) for `req`; raise SelectionError when impossible."""
    return _select(registry, "attention", name, lambda s: attention_unusable_reasons(s, req), flag, req)


def select_lora_backend(
    registry: Registry, name: str, req: LoraRequirements, flag: str = "--lora-backend"
) -> Selection:
    return _select(registry, "lora", name, lambda s: lora_unusable_reasons(s, req), flag, req)


NONE = "none"


def select_quant_method(registry: Registry, name: str, req: QuantRequirements,
                        flag: str = "--quantization") -> Selection | None:
    """The quantization method for `name` (NAME, NAME@PLUGIN, `auto` or `none`), or None: unquantized.

    auto: None for a checkpoint without quantization_config; else the highest-priority usable
    method declaring its quant_method. none: None, refused for a quantized checkpoint (its weights
    cannot run as they are). Every refusal is one SelectionError line with every reason and fix."""
    fmt = req.checkpoint_format
    if name == NONE:
        if fmt is not None:
            raise SelectionError(f"{flag} none: the checkpoint is quantized (quantization_config quant_method "
                                 f"{fmt!r}), so its weights need a method that loads them; expected auto or one of: "
                                 f"{_quant_loaders(registry, fmt) or 'none registered'}")
        return None
    if name == AUTO and fmt is None:
        logger.info("%s auto: the checkpoint has no quantization_config; running unquantized", flag)
        return None
    if name == AUTO:
        candidates = [reg for reg in registry.registrations("quant") if fmt in reg.item.checkpoint_formats]
        if not candidates:
            raise SelectionError(f"{flag} auto: no registered quantization method loads quant_method {fmt!r} "
                                 f"checkpoints; registered: {_listing(registry, 'quant') or 'none'}"
                                 + _not_loaded(registry))
    return _select(registry, "quant", name, lambda s: quant_unusable_reasons(s, req), flag, req)


def select_moe_backend(registry: Registry, name: str, req: MoeRequirements,
                       flag: str = "--moe-backend") -> Selection:
    """The MoE backend for `name` (NAME, NAME@PLUGIN or `auto`) serving a MoE model; called only
    for a MoE model (for a dense one the flag is unused). Never a fallback: `auto` under CUDA graphs
    with no graph-capable backend is a SelectionError naming the fix, like any other refusal."""
    return _select(registry, "moe", name, lambda s: moe_unusable_reasons(s, req), flag, req)


def _quant_loaders(registry: Registry, fmt: str) -> str:
    return _join(sorted({reg.item.name for reg in registry.registrations("quant") if fmt in reg.item.checkpoint_formats}))


def _select(registry: Registry, kind: str, name: str, check, flag: str, req) -> Selection:
    if name == AUTO:
        return _select_auto(registry, kind, check, flag, req)
    chosen = resolve(registry, kind, name, flag)
    spec = chosen.item
    reasons = check(spec)
    if reasons:
        usable = sorted(_pinned(reg, registry, kind) for reg in registry.registrations(kind) if not check(reg.item))
        raise SelectionError(
            f"{flag} {name} (plugin {chosen.plugin!r}) cannot run here: {'; '.join(reasons)}."
            + (f" To fix: {spec.install_hint}." if install_hint_applies(spec, req.platform) else "")
            + f" Usable here: {_join(usable) or 'none'}"
        )
    return Selection(spec, chosen.plugin, f"{name} chosen explicitly by {flag}")


def resolve(registry: Registry, kind: str, name: str, flag: str) -> Registered:
    """The registration `name` refers to: NAME, or NAME@WHO where WHO is the plugin (entry-point
    name) or the distribution that registered it. Unknown, or registered by several plugins and
    not pinned: SelectionError naming every candidate and how to pin one."""
    base, _, who = name.partition("@")
    candidates = registry.registrations(kind, base)
    if not candidates:
        noun = "backend" if KINDS[kind].pinnable else KINDS[kind].label
        raise SelectionError(
            f"{flag}: unknown {noun} {base!r}; registered: {_listing(registry, kind) or 'none'}"
            + (", or 'auto'" if KINDS[kind].pinnable else "") + _not_loaded(registry)
        )
    if who:
        pinned = [reg for reg in candidates if who in (reg.plugin, reg.distribution)]
        if not pinned:
            raise SelectionError(
                f"{flag} {name}: no plugin or distribution {who!r} registered {KINDS[kind].label} {base!r}; "
                f"it is registered by {_by(candidates)}"
            )
        candidates = pinned
    if len(candidates) > 1:
        raise SelectionError(_ambiguity(kind, base, candidates, flag))
    return candidates[0]


def require_known(registry: Registry, kind: str, name: str, flag: str) -> None:
    """Raise SelectionError when `name` is neither `auto` nor one registration (see `resolve`)."""
    if name != AUTO:
        resolve(registry, kind, name, flag)


def _select_auto(registry: Registry, kind: str, check, flag: str, req) -> Selection:
    # NOTE: equal priorities are broken by name, then by plugin name (alphabetical), so `auto`
    # never depends on installation or entry-point order.
    skipped: list[str] = []
    usable: list[Registered] = []
    passed = 0  # how many were skipped before the first usable one (those the log explains)
    for reg in sorted(registry.registrations(kind), key=lambda r: (-r.item.priority, r.item.name, r.plugin)):
        reasons = check(reg.item)
        shared = registry.registrations(kind, reg.item.name)
        if reasons:
            skipped.append(f"{reg.item.name} (plugin {reg.plugin!r}): {', '.join(reasons)}")
        elif len(shared) > 1 and not usable:  # the best usable name is shared: the user must pin one
            raise SelectionError(_ambiguity(kind, reg.item.name, shared, f"{flag} auto"))
        elif len(shared) == 1:
            passed = passed if usable else len(skipped)
            usable.append(reg)
    if not usable:
        raise SelectionError(f"{flag} auto: no registered backend can run {_describe(req)}; "
                             + ("; ".join(skipped) if skipped else "none is registered"))
    chosen = usable[0]
    why = f"{chosen.item.name} chosen by {flag} auto (priority {chosen.item.priority}, plugin {chosen.plugin!r})"
    if passed:
        why += "; skipped " + "; ".join(skipped[:passed])
    logger.info(why)
    return Selection(chosen.item, chosen.plugin, why, alternatives=tuple(usable[1:]))


def _ambiguity(kind: str, name: str, candidates: list[Registered], flag: str) -> str:
    pins = " or ".join(f"{name}@{reg.plugin}" for reg in candidates)
    return (f"{flag}: {KINDS[kind].label} {name!r} is registered by {len(candidates)} plugins: "
            f"{_by(candidates)}; pin one with {flag.split()[0]} {pins}")


def _by(candidates: list[Registered]) -> str:
    return " and ".join(f"plugin {reg.plugin!r}" + (f" (distribution {reg.distribution})" if reg.distribution else "")
                        for reg in candidates)


def _pinned(reg: Registered, registry: Registry, kind: str) -> str:
    """How a user names `reg` on the command line: NAME, or NAME@PLUGIN when the name is shared."""
    name = reg.item.name
    return f"{name}@{reg.plugin}" if len(registry.registrations(kind, name)) > 1 else name


def _not_loaded(registry: Registry) -> str:
    """The installed plugins that did not load, grouped by why (the backend may be theirs)."""
    by_reason: dict[str, list[str]] = {}
    for name, why in sorted(registry.not_loaded.items()):
        by_reason.setdefault(why, []).append(name)
    return "".join(f". Not loaded, {why}: {', '.join(names)}" for why, names in by_reason.items())


def _describe(req) -> str:
    if isinstance(req, MoeRequirements):
        uses = [label for on, label in ((req.graphs, "CUDA graphs"), (req.compile, "torch.compile")) if on]
        return (f"a MoE model ({req.num_experts} experts, top-k {req.top_k}) on platform {req.platform!r} with dtype "
                f"{req.dtype}" + (f", weights quantized by {req.quant!r}" if req.quant else "")
                + (f", under {' and '.join(uses)}" if uses else ""))
    if isinstance(req, QuantRequirements):
        return f"quant_method {req.checkpoint_format!r} checkpoints on platform {req.platform!r} with dtype {req.dtype}"
    return f"on platform {req.platform!r} with dtype {req.dtype}" + (
        f", head dim {req.head_dim}" if hasattr(req, "head_dim") else ""
    )


def _listing(registry: Registry, kind: str) -> str:
    return ", ".join(f"{KINDS[kind].key(reg.item)} (plugin {reg.plugin!r})" for reg in registry.registrations(kind))
