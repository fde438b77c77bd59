"""Choosing and building the speculative worker from `--speculative-algorithm` through the registry."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from backplane.contracts.protocols import SchedulerParticipant
from backplane.speculative.context import SpecContext, TargetRunner
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
    if spec.needs_draft_model and not args.speculative_draft_model:
        raise ValueError(f"--speculative-algorithm {name}: needs a draft model; pass --speculative-draft-model PATH")
    if getattr(args, "speculative_token_map", None) and not spec.needs_draft_model:
        raise ValueError(f"--speculative-token-map: only algorithms with a draft model (eagle) use it; "
                         f"--speculative-algorithm is {name}")
    return spec


def build_spec_worker(args: Any, plugin_set: Any, runner: TargetRunner,
                      participants: Sequence[SchedulerParticipant] = ()) -> SpecWorker | None:
    """The worker of the selected algorithm (built by its plugin's factory), or None.

    participants: the scheduler's batch participants (the LoraManager), which the worker's verify
    batches go through as well."""
    spec = check_spec_settings(args, plugin_set)
    if spec is None:
        return None
    plugin = plugin_set.registry.provenance("spec", spec.name).plugin
    from backplane.plugin.registry import Registered
    from backplane.plugin.runtime import build

    return build(Registered(spec, plugin), SpecContext(runner=runner, args=args, spec=spec, plugin=plugin,
                                    participants=tuple(participants)), kind="spec")


def sampling_refusal(spec: Any, req: Any) -> str | None:
    """Why `req` cannot run under `spec` (non-greedy sampling without support), or None."""
    if spec is None or spec.supports_sampling or req.params.is_greedy:
        return None
    return (f"request {req.rid}: --speculative-algorithm {spec.name} supports greedy decoding only; "
            f"expected temperature 0 (or top_k 1), got temperature {req.params.temperature}")
