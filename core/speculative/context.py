"""What a speculative algorithm's factory receives: SpecContext (the TargetRunner it reads is in target.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from backplane.speculative.request import engine_requests
from backplane.speculative.target import TargetRunner, as_target

if TYPE_CHECKING:

    from backplane.contracts.protocols import SchedulerParticipant
    from backplane.plugin.registry import SpecAlgorithmSpec
    from backplane.settings import EngineArgs

__all__ = ["SpecContext", "TargetRunner"]


@dataclass
class SpecContext:
    """What a spec algorithm's factory receives.

    runner: the target, as far as an algorithm reads it (a TargetView; whatever runner is given
      is wrapped in one)
    args: the final EngineArgs; spec: the selected SpecAlgorithmSpec; plugin: the name of the
      plugin that registered the algorithm
    options: the parsed options of the plugin's settings group (`--<group>.<option>`, or
      `Engine(plugin_options={group: {...}})`), None when the plugin registered no group
    participants: the scheduler's own SchedulerParticipants (the LoraManager); the verify batch
      goes through their `prepare_batch(batch, reqs)` too (`prepare_target`)
    """

    runner: TargetRunner
    args: EngineArgs
    spec: SpecAlgorithmSpec
    plugin: str = ""
    participants: Sequence[SchedulerParticipant] = ()
    options: Any = None

    def __post_init__(self):
        self.runner = as_target(self.runner)

    def prepare_target(self, batch: Any, reqs: list) -> None:
        """Let every participant bind its state for a target batch of `reqs` (SpecRequests or the
        engine's requests; LoRA segments)."""
        reqs = engine_requests(reqs)
        for p in self.participants:
            p.prepare_batch(batch, reqs)

    @property
    def num_draft_tokens(self) -> int:
        return int(self.args.speculative_num_draft_tokens)

    def make_attention_backend(self, role: str, req_to_token_pool, token_to_kv_pool, layers: list) -> Any:
        """A fresh instance of the target's `role` ("prefill" or "decode") attention backend over
        other pools (a draft model's), for the attention layers `layers` (AttentionLayerInfo).
        A draft's forward binds it in its ForwardContext
        (`model_ctx.bind(model_ctx.context_for(batch, attn_backend=backend))`)."""
        return self.runner.make_attention_backend(role, req_to_token_pool, token_to_kv_pool, layers)
