"""Choosing and building the speculative worker from `--speculative-algorithm` through the registry."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from backplane.contracts.protocols import SchedulerParticipant
from backplane.speculative.context import SpecContext
from backplane.speculative.target import TargetView
from backplane.speculative.worker import SpecWorker


def check_spec_settings(args: Any, plugin_set: Any) -> Any:
    """The SpecAlgorithmSpec selected by the settings (None without one); a clear ValueError when
    the name is unknown or the combination cannot work. Runs before any model is built."""
    name = args.speculative_algorithm
    if not name:
        return None
    specs = plugin_set.registry.specs("spec")
    if name not in specs:
        known = ", ".join(sorted(specs)) or "none (install a speculative-decoding plugin)"
        raise ValueError(f"--speculative-algorithm {name!r}: unknown; registered algorithms: {known}")
    spec = specs[name]
    if args.lora_paths and not spec.supports_lora:
        raise ValueError(f"--speculative-algorithm {name}: does not support LoRA adapters, got --lora-paths "
                         f"{','.join(args.lora_paths)}; drop one of the two")
    group, options = algorithm_options(args, plugin_set.registry, spec.name)
    if spec.needs_draft_model and not args.speculative_draft_model and not getattr(options, "draft_model", None):
        flag = f"--{group}.draft-model" if options is not None and hasattr(options, "draft_model") else \
            "--speculative-draft-model"
        raise ValueError(f"--speculative-algorithm {name}: needs a draft model; pass {flag} PATH")
    if getattr(args, "speculative_token_map", None) and not spec.needs_draft_model:
        raise ValueError(f"--speculative-token-map: only algorithms with a draft model (eagle) use it; "
                         f"--speculative-algorithm is {name}")
    return spec


def algorithm_help(registry: Any) -> str:
    """The help of --speculative-algorithm, naming the registered algorithms."""
    names = sorted(registry.specs("spec"))
    return f"registered algorithm ({', '.join(names)})" if names else "registered algorithm (none installed)"


def algorithm_options(args: Any, registry: Any, name: str) -> tuple[str | None, Any]:
    """(group, options) of the settings group of the plugin that registered algorithm `name`:
    the parsed options in `args.plugin_options` (CLI, env, `Engine(plugin_options=...)`), else the
    group's defaults overlaid by its env vars (EngineArgs built directly); (None, None) without a group."""
    from backplane.settings import build_plugin_options

    group = registry.options_group(registry.provenance("spec", name).plugin)
    if group is None:
        return None, None
    options = args.options_for(group)
    if options is None:
        options = build_plugin_options({group: registry.items["settings"][group].item.model}, {})[group]
    return group, options


def build_spec_worker(args: Any, plugin_set: Any, runner: Any,
                      participants: Sequence[SchedulerParticipant] = ()) -> SpecWorker | None:
    """The worker of the selected algorithm (built by its plugin's factory), or None.

    runner: the engine's model runner (the algorithm sees it through a TargetView);
    participants: the scheduler's batch participants (the LoraManager), which the worker's verify
    batches go through as well."""
    spec = check_spec_settings(args, plugin_set)
    if spec is None:
        return None
    plugin = plugin_set.registry.provenance("spec", spec.name).plugin
    from backplane.plugin.registry import Registered
    from backplane.plugin.runtime import build

    _, options = algorithm_options(args, plugin_set.registry, spec.name)
    ctx = SpecContext(runner=TargetView(runner), args=args, spec=spec, plugin=plugin,
                      participants=tuple(participants), options=options)
    return build(Registered(spec, plugin), ctx, kind="spec")


def sampling_refusal(spec: Any, req: Any) -> str | None:
    """Why `req` cannot run under `spec` (non-greedy sampling without support), or None."""
    if spec is None or spec.supports_sampling or req.params.is_greedy:
        return None
    return (f"request {req.rid}: --speculative-algorithm {spec.name} supports greedy decoding only; "
            f"expected temperature 0 (or top_k 1), got temperature {req.params.temperature}")
