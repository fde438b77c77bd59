"""What `backplane plugins` shows: every plugin, what it registered, and what is usable here."""

from __future__ import annotations

from typing import Any

from backplane.plugin.manager import PluginSet


def current_platform() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _backend_status(kind: str, spec: Any, platform: str) -> dict[str, Any]:
    reasons = [] if spec.available() is None else [spec.available()]
    if platform not in spec.platforms:
        reasons.append(f"platform {platform!r} not supported (supports: {', '.join(spec.platforms)})")
    entry = {"name": spec.name, "description": spec.description, "priority": spec.priority,
             "platforms": list(spec.platforms), "usable": not reasons, "reasons": reasons}
    if reasons and spec.install_hint and spec.available() is not None:
        entry["install"] = spec.install_hint
    if kind == "attention":
        entry.update(modes=list(spec.modes), graph_modes=list(spec.graph_modes),
                     head_dims=list(spec.head_dims) if spec.head_dims else "any")
    return entry


def describe_plugins(plugin_set: PluginSet) -> dict[str, Any]:
    platform = current_platform()
    registry = plugin_set.registry
    backends = {
        kind: [_backend_status(kind, spec, platform) | {"plugin": registry.provenance(kind, name).plugin}
               for name, spec in sorted(registry.specs(kind).items())]
        for kind in ("attention", "lora")
    }
    return {
        "platform": platform,
        "plugins": [vars(info) | {} for info in plugin_set.plugins],
        "attention_backends": backends["attention"],
        "lora_backends": backends["lora"],
        "custom_ops": sorted(registry.specs("custom_op")),
        "spec_algorithms": sorted(registry.specs("spec")),
        "models": sorted(registry.specs("model")),
        "settings_groups": sorted(registry.specs("settings")),
        "warnings": plugin_set.warnings,
    }


def format_plugins(report: dict[str, Any]) -> str:
    lines = [f"platform: {report['platform']}", "", "plugins:"]
    for p in report["plugins"]:
        origin = "builtin" if p["builtin"] else f"{p['distribution']} {p['version']}"
        status = f"FAILED: {p['error']}" if p["error"] else ", ".join(p["registered"]) or "-"
        lines.append(f"  {p['name']:<24} {origin:<24} {status}")
    for title, key in (("attention backends", "attention_backends"), ("LoRA backends", "lora_backends")):
        lines += ["", f"{title}:"]
        for b in report[key]:
            state = "usable" if b["usable"] else "unusable: " + "; ".join(b["reasons"])
            lines.append(f"  {b['name']:<14} prio {b['priority']:<4} plugin {b['plugin']:<22} {state}")
    for title, key in (("speculative algorithms", "spec_algorithms"), ("models", "models"),
                       ("settings groups", "settings_groups")):
        lines.append(f"\n{title}: {', '.join(report[key]) or '-'}")
    return "\n".join(lines)
