"""What `backplane plugins` shows: every plugin, what it registered, and what is usable here."""

from __future__ import annotations

from typing import Any

from backplane.plugin.manager import PluginSet
from backplane.plugin.registry import Registered, Registry
from backplane.plugin.version import PLUGIN_API_VERSION
from backplane.plugin.selection import availability_reasons, install_hint_applies


def current_platform() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _capabilities(kind: str, spec: Any) -> dict[str, Any]:
    """The capabilities a backend declares (see the spec dataclasses for each default)."""
    caps: dict[str, Any] = {"platforms": list(spec.platforms), "dtypes": list(spec.dtypes)}
    if kind == "attention":
        caps.update(modes=list(spec.modes), graph_modes=list(spec.graph_modes),
                    piecewise_graph_modes=list(getattr(spec, "piecewise_graph_modes", ())),
                    head_dims=list(spec.head_dims) if spec.head_dims else "any", custom_mask=spec.custom_mask,
                    sliding_window=spec.sliding_window, logit_softcap=spec.logit_softcap,
                    seq_len_fill_value=spec.seq_len_fill_value)
    elif kind == "quant":
        caps.update(checkpoint_formats=list(spec.checkpoint_formats), supports_online=spec.supports_online,
                    supports_lora=spec.supports_lora, supports_tp=spec.supports_tp,
                    supports_graph=spec.supports_graph, supports_compile=spec.supports_compile)
    elif kind == "moe":
        caps.update(max_top_k=_any(spec.max_top_k), max_experts=_any(spec.max_experts),
                    supports_graph=spec.supports_graph, supports_compile=spec.supports_compile,
                    quant_methods=list(spec.quant_methods))
    else:
        caps.update(max_rank=_any(spec.max_rank), supports_graph=spec.supports_graph,
                    graph_modes=list(getattr(spec, "graph_modes", ())) if spec.supports_graph else [])
    return caps


def _any(limit: int | None) -> int | str:
    return "any" if limit is None else limit


def _backend_status(kind: str, reg: Registered, registry: Registry, platform: str) -> dict[str, Any]:
    spec = reg.item
    reasons = availability_reasons(spec, platform)
    shared = [other.plugin for other in registry.registrations(kind, spec.name) if other is not reg]
    entry = {"name": spec.name, "plugin": reg.plugin, "distribution": reg.distribution,
             "description": spec.description, "priority": spec.priority, "usable": not reasons,
             "reasons": reasons, "install": spec.install_hint or None,
             "install_needed": install_hint_applies(spec, platform), **_capabilities(kind, spec)}
    if shared:
        entry["shared_with"] = shared
        entry["select_as"] = f"{spec.name}@{reg.plugin}"
    return entry


def describe_plugins(plugin_set: PluginSet) -> dict[str, Any]:
    platform = current_platform()
    registry = plugin_set.registry
    backends = {kind: [_backend_status(kind, reg, registry, platform) for reg in registry.registrations(kind)]
                for kind in ("attention", "lora", "quant", "moe")}
    return {
        "platform": platform,
        "plugin_api": PLUGIN_API_VERSION,
        "plugins": [vars(info) | {} for info in plugin_set.plugins],
        "attention_backends": backends["attention"],
        "lora_backends": backends["lora"],
        "quant_methods": backends["quant"],
        "moe_backends": backends["moe"],
        "custom_ops": sorted(registry.specs("custom_op")),
        "spec_algorithms": sorted(registry.specs("spec")),
        "models": sorted(registry.specs("model")),
        "settings_groups": sorted(registry.specs("settings")),
        "warnings": plugin_set.warnings,
    }


def _format_capabilities(b: dict[str, Any]) -> str:
    parts = [f"dtypes {','.join(b['dtypes'])}"]
    if "checkpoint_formats" in b:
        parts += [f"formats {','.join(b['checkpoint_formats']) or '-'}", f"online {'yes' if b['supports_online'] else 'no'}"]
        parts += [f"{label} {'yes' if b[key] else 'no'}" for key, label in (
            ("supports_lora", "lora"), ("supports_tp", "tp"), ("supports_graph", "graphs"),
            ("supports_compile", "compile"))]
    elif "max_top_k" in b:
        parts += [f"max top-k {b['max_top_k']}", f"max experts {b['max_experts']}",
                  f"graphs {'yes' if b['supports_graph'] else 'no'}", f"compile {'yes' if b['supports_compile'] else 'no'}",
                  f"quantized {','.join(b['quant_methods']) or '-'}"]
    elif "modes" in b:
        head_dims = b["head_dims"] if b["head_dims"] == "any" else ",".join(map(str, b["head_dims"]))
        parts += [f"modes {','.join(b['modes'])}", f"graphs {','.join(b['graph_modes']) or '-'}"
                  + (f" (piecewise {','.join(b['piecewise_graph_modes'])})" if b.get("piecewise_graph_modes") else ""),
                  f"head dims {head_dims}"]
        parts += [f"{label} {'yes' if b[key] else 'no'}" for key, label in (
            ("custom_mask", "custom mask"), ("sliding_window", "sliding window"), ("logit_softcap", "soft-cap"))]
    else:
        parts += [f"max rank {b['max_rank']}", f"graphs {','.join(b.get('graph_modes') or []) or '-'}"]
    return "; ".join(parts)


def format_plugins(report: dict[str, Any]) -> str:
    lines = [f"platform: {report['platform']}", f"plugin API: {report['plugin_api']}", "",
             "plugins (distribution, plugin API it needs, load time, what it registered):"]
    for p in report["plugins"]:
        origin = "builtin" if p["builtin"] else f"{p['distribution']} {p['version']}"
        status = f"FAILED: {p['error']}" if p["error"] else ", ".join(p["registered"]) or "-"
        lines.append(f"  {p['name']:<24} {origin:<24} api {p['api'] or '-':<4} {p['load_seconds']:6.3f}s  {status}")
    for title, key in (("attention backends", "attention_backends"), ("LoRA backends", "lora_backends"),
                       ("quantization methods", "quant_methods"), ("MoE backends", "moe_backends")):
        lines += ["", f"{title}:"]
        for b in report.get(key, []):
            state = "usable" if b["usable"] else "unusable: " + "; ".join(b["reasons"])
            name = b.get("select_as", b["name"])
            lines.append(f"  {name:<14} prio {b['priority']:<4} plugin {b['plugin']:<22} {state}")
            lines.append(f"  {'':<14} {_format_capabilities(b)}")
            if b["install_needed"]:  # a missing dependency, not a missing device
                lines.append(f"  {'':<14} install: {b['install']}")
            if "shared_with" in b:
                lines.append(f"  {'':<14} name also registered by {', '.join(b['shared_with'])}: "
                             f"select it as {b['select_as']}")
    for title, key in (("speculative algorithms", "spec_algorithms"), ("models", "models"),
                       ("settings groups", "settings_groups")):
        lines.append(f"\n{title}: {', '.join(report[key]) or '-'}")
    return "\n".join(lines)
