"""What a speculative algorithm's factory receives: SpecContext, and the TargetRunner it reads."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from backplane.contracts.batch import ForwardBatch
    from backplane.executor.graph_runner import GraphRunner
    from backplane.contracts.memory import ReqToTokenPool, TokenToKVPool
    from backplane.contracts.protocols import SchedulerParticipant
    from backplane.contracts.model import ModelOutput
    from backplane.models.base import ModelContext
    from backplane.plugin.registry import Registry, SpecAlgorithmSpec
    from backplane.plugin.selection import Selection
    from backplane.settings import EngineArgs


@runtime_checkable
class TargetRunner(Protocol):
    """What an algorithm reads of the target's model runner (the ModelRunner satisfies it).

    model: the target model (a draft head shares its embedding and lm_head; `hidden_size`,
    `vocab_size`); model_ctx: its ModelContext (custom ops, tensor-parallel position); dtype,
    device; req_to_token_pool, token_to_kv_pool: the target's pools (verify allocates its slots
    there, a draft mirrors their slot numbers); context_len: the longest sequence served;
    attn_choices: the selected attention backend of each role ("prefill" serves extend, verify
    and draft extend; "decode"), with their declared graph modes; registry, args: where their
    option groups and values live; graph_runner: the target's GraphRunner once `init_cuda_graphs` ran (None: no
    graphs), whose batch sizes a draft's graphs follow; seq_len_fill_value: what padded requests
    carry as seq_len; forward(batch, capture_hidden=False): one target forward, through its graphs
    when it can (with the final hidden states in the output when capture_hidden).
    """

    model: torch.nn.Module
    model_ctx: ModelContext
    dtype: torch.dtype
    device: torch.device
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: TokenToKVPool
    context_len: int
    attn_choices: dict[str, Selection]
    registry: Registry
    args: EngineArgs
    graph_runner: GraphRunner | None

    @property
    def seq_len_fill_value(self) -> int: ...

    def forward(self, batch: ForwardBatch, *, capture_hidden: bool = False) -> ModelOutput: ...


@dataclass
class SpecContext:
    """What a spec algorithm's factory receives.

    runner: the target model runner, as far as an algorithm reads it (TargetRunner)
    args: the final EngineArgs; spec: the selected SpecAlgorithmSpec; plugin: the name of the
      plugin that registered the algorithm
    participants: the scheduler's own SchedulerParticipants (the LoraManager); the verify batch
      goes through their `prepare_batch(batch, reqs)` too (`prepare_target`)
    """

    runner: TargetRunner
    args: EngineArgs
    spec: SpecAlgorithmSpec
    plugin: str = ""
    participants: Sequence[SchedulerParticipant] = ()

    def prepare_target(self, batch: Any, reqs: list) -> None:
        """Let every participant bind its state for a target batch of `reqs` (LoRA segments)."""
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
        from backplane.speculative.draft_parts import make_attention_backend

        return make_attention_backend(self.runner, role, req_to_token_pool, token_to_kv_pool, layers)
