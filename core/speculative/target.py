"""TargetRunner: what a speculative algorithm reads of the target's model runner."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from backplane.contracts.batch import ForwardBatch
    from backplane.contracts.memory import ReqToTokenPool, TokenToKVPool
    from backplane.contracts.model import ModelOutput
    from backplane.executor.graph_runner import GraphRunner
    from backplane.models.base import ModelContext
    from backplane.plugin.registry import Registry
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
