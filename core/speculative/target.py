"""TargetRunner: what a speculative algorithm reads of the target; TargetView, the core's facade.

The algorithm's factory gets `ctx.runner`, a `TargetView` over the engine's model runner: the
target model and its pools, one `forward`, and the few facts about graphs and attention an
algorithm needs (`graph_batch_sizes`, `can_capture`, `seq_len_fill_value`,
`make_attention_backend`). The runner's private parts (its graph runner, its backend selections)
stay behind it.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from backplane.contracts.attention import AttentionBackend, AttentionBackendContext
from backplane.contracts.batch import ForwardMode

if TYPE_CHECKING:
    import torch

    from backplane.contracts.batch import ForwardBatch
    from backplane.contracts.memory import ReqToTokenPool, TokenToKVPool
    from backplane.contracts.model import ModelOutput
    from backplane.models.base import ModelContext
    from backplane.settings import EngineArgs

# Which attention role serves each forward mode: "prefill" serves every extend-like mode.
ROLE_OF_MODE = {"extend": "prefill", "target_verify": "prefill", "draft_extend": "prefill", "decode": "decode"}
# Runner attributes of the 0.1 contract that are no longer part of it (until 0.3), with what replaces each.
DEPRECATED = {"graph_runner": "graph_batch_sizes", "attn_choices": "can_capture(mode) and make_attention_backend",
              "registry": "make_attention_backend"}


@runtime_checkable
class TargetRunner(Protocol):
    """What an algorithm reads of the target (`ctx.runner`, a TargetView).

    model: the target model (a draft head shares its embedding and lm_head; `hidden_size`,
    `vocab_size`); model_ctx: its ModelContext (custom ops, tensor-parallel position); dtype,
    device; req_to_token_pool, token_to_kv_pool: the target's pools (verify allocates its slots
    there, a draft mirrors their slot numbers); context_len: the longest sequence served; args:
    the final EngineArgs; graph_batch_sizes: the batch sizes the target captured decode graphs
    for, ascending (empty without graphs; read it in `init_cuda_graphs`, after the target's
    capture); can_capture(mode): whether the attention backend serving `mode` declares it
    capturable in a CUDA graph; seq_len_fill_value: what padded requests carry as seq_len;
    make_attention_backend(role, req_to_token_pool, token_to_kv_pool, layers): another instance
    of the target's "prefill" or "decode" attention backend over a draft's pools;
    forward(batch, capture_hidden=False): one target forward, through its graphs when it can
    (with the final hidden states in the output when capture_hidden).
    """

    model: torch.nn.Module
    model_ctx: ModelContext
    dtype: torch.dtype
    device: torch.device
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: TokenToKVPool
    context_len: int
    args: EngineArgs

    @property
    def graph_batch_sizes(self) -> tuple[int, ...]: ...

    @property
    def seq_len_fill_value(self) -> int: ...

    def can_capture(self, mode: str) -> bool: ...

    def make_attention_backend(self, role: str, req_to_token_pool: ReqToTokenPool, token_to_kv_pool: TokenToKVPool,
                               layers: list) -> AttentionBackend: ...

    def forward(self, batch: ForwardBatch, *, capture_hidden: bool = False) -> ModelOutput: ...


class TargetView:
    """The TargetRunner an algorithm gets: a facade over the engine's model runner (any object
    with the runner's model, pools, `attn_choices`, `registry`, `args`, `graph_runner` and
    `forward`). The 0.1 attributes `graph_runner`, `attn_choices` and `registry` still answer,
    with a DeprecationWarning naming what replaces them; any other runner attribute is refused."""

    __slots__ = ("_runner",)

    def __init__(self, runner: Any):
        self._runner = runner

    model = property(lambda self: self._runner.model)
    model_ctx = property(lambda self: self._runner.model_ctx)
    dtype = property(lambda self: self._runner.dtype)
    device = property(lambda self: self._runner.device)
    req_to_token_pool = property(lambda self: self._runner.req_to_token_pool)
    token_to_kv_pool = property(lambda self: self._runner.token_to_kv_pool)
    context_len = property(lambda self: self._runner.context_len)
    args = property(lambda self: self._runner.args)

    @property
    def graph_batch_sizes(self) -> tuple[int, ...]:
        graphs = self._runner.graph_runner
        return tuple(sorted(graphs.sizes)) if graphs is not None else ()

    @property
    def seq_len_fill_value(self) -> int:
        return int(self._runner.seq_len_fill_value)

    def can_capture(self, mode: str) -> bool:
        """Whether the attention backend serving `mode` ("extend", "decode", "target_verify",
        "draft_extend") declares that mode capturable in a CUDA graph."""
        if mode not in ROLE_OF_MODE:
            raise ValueError(f"TargetRunner.can_capture: mode {mode!r}: expected one of "
                             f"{', '.join(m.value for m in ForwardMode)}")
        return mode in self._runner.attn_choices[ROLE_OF_MODE[mode]].spec.graph_modes

    def make_attention_backend(self, role: str, req_to_token_pool, token_to_kv_pool, layers: list) -> AttentionBackend:
        """A new instance of the target's `role` ("prefill" or "decode") attention backend over
        other pools (a draft model's), for the attention layers `layers` (AttentionLayerInfo)."""
        choices = self._runner.attn_choices
        if role not in choices:
            raise ValueError(f"attention role: expected one of {', '.join(sorted(choices))}, got {role!r}")
        if not layers:
            raise ValueError("make_attention_backend: layers: expected the draft's AttentionLayerInfo list, got none")
        choice, info, runner = choices[role], layers[0], self._runner
        group = runner.registry.options_group(choice.plugin)
        ctx = AttentionBackendContext(
            num_heads=info.num_heads, num_kv_heads=info.num_kv_heads, head_dim=info.head_dim,
            num_layers=len(layers), dtype=runner.dtype, device=runner.device,
            req_to_token_pool=req_to_token_pool, token_to_kv_pool=token_to_kv_pool,
            max_context_len=req_to_token_pool.max_context_len,
            options=runner.args.options_for(group) if group else None,
        )
        return choice.spec.factory(ctx)

    def forward(self, batch, *, capture_hidden: bool = False):
        return self._runner.forward(batch, capture_hidden=capture_hidden)

    def __getattr__(self, name: str) -> Any:
        if name in DEPRECATED:
            warnings.warn(f"TargetRunner.{name} is deprecated (until 0.3): use TargetRunner.{DEPRECATED[name]} "
                          "(backplane.speculative)", DeprecationWarning, stacklevel=2)
            return getattr(self._runner, name)
        raise AttributeError(f"TargetRunner has no attribute {name!r}; an algorithm reads: "
                             f"{', '.join(sorted(CONTRACT))}")


def as_target(runner: Any) -> TargetView:
    """`runner` as a TargetView (a view is returned as it is)."""
    return runner if isinstance(runner, TargetView) else TargetView(runner)


CONTRACT = ("model", "model_ctx", "dtype", "device", "req_to_token_pool", "token_to_kv_pool", "context_len", "args",
            "graph_batch_sizes", "seq_len_fill_value", "can_capture", "make_attention_backend", "forward")
