"""The AttentionBackend contract: one metadata path for eager runs, graph capture and replay.

Call order for one forward pass (eager):
    backend.init_forward_metadata(batch)            # once, before any layer
    backend.forward(q, k, v, layer, batch)          # per layer; dispatches on batch.forward_mode
Under CUDA graphs:
    backend.init_graph_state(max_bs, max_num_tokens)      # once, allocate static buffers
    backend.init_metadata_for_capture(key, batch)         # bind static buffers, then capture
    backend.init_metadata_for_replay(key, batch)          # refresh the same buffers in place, replay
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from backplane.contracts.batch import ForwardBatch

if TYPE_CHECKING:
    from backplane.contracts.memory import ReqToTokenPool, TokenToKVPool


@dataclass(frozen=True)
class AttentionLayerInfo:
    """What a backend needs to know about the layer it runs.

    sliding_window: keys at positions p_q - sliding_window < p_k <= p_q are visible; 0 means no window.
    logit_softcap: scores become cap * tanh(score / cap); 0 means no cap.
    """

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    sliding_window: int = 0
    logit_softcap: float = 0.0


@dataclass
class AttentionBackendContext:
    """Everything a backend factory receives. Head counts are per tensor-parallel rank."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    dtype: torch.dtype
    device: torch.device
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: TokenToKVPool
    max_context_len: int
    options: Any = None  # the plugin's settings group (a pydantic model), if it registered one
    # NOTE: the first release's field, kept for its plugins (deprecated: read `options` instead).
    server_args: Any = None


class AttentionBackend(ABC):
    """Base class of every attention backend.

    Tensor layouts (all on the pool's device):
      q: [num_tokens, num_heads, head_dim]
      k, v: [num_tokens, num_kv_heads, head_dim], the keys/values of the new tokens
      returns o: [num_tokens, num_heads, head_dim] in q's dtype
    Before attending, `forward_extend` and `forward_decode` write k and v into the KV pool at
    `batch.out_cache_loc` (for layer `layer.layer_id`), unless the backend opted in to
    `fuses_rotary_kv_write` and is called with `kv_written=True`.
    """

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Plan for one eager forward pass; called once before the first layer."""

    @abstractmethod
    def forward_extend(self, q, k, v, layer: AttentionLayerInfo, batch: ForwardBatch) -> torch.Tensor:
        """EXTEND, TARGET_VERIFY and DRAFT_EXTEND: new tokens attend to their prefix and each other."""

    @abstractmethod
    def forward_decode(self, q, k, v, layer: AttentionLayerInfo, batch: ForwardBatch) -> torch.Tensor:
        """DECODE: one new token per request attends to every cached token of its request."""

    def init_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate the static buffers that captured graphs read; called once before capture."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_metadata_for_capture(self, key: Any, batch: ForwardBatch) -> None:
        """Bind the metadata of the graph `key` to the static buffers before it is captured."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_metadata_for_replay(self, key: Any, batch: ForwardBatch) -> None:
        """Refresh, in place, the static buffers of graph `key` for the (padded) `batch`."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def fuses_rotary_kv_write(self, batch: ForwardBatch) -> bool:
        """Opt-in, default False: whether, for `batch`, the attention layer may apply rotary and write
        the new tokens' K/V into the pool in one op (`rotary_kv_write`) before calling the backend.

        A backend that returns True receives `kv_written=True` in `forward_extend` / `forward_decode`
        for such calls (k and v are still passed, rotated) and must then not write them again. A
        backend that keeps the default is called exactly as before: rotated q, k, v, and it writes K/V.
        Under torch.compile the same choice is made at run time inside the opaque op
        `torch.ops.backplane.rotary_attention` (for a backend class that overrides this method).
        """
        return False

    def forward(self, q, k, v, layer: AttentionLayerInfo, batch: ForwardBatch, kv_written: bool = False) -> torch.Tensor:
        run = self.forward_decode if batch.forward_mode.is_decode else self.forward_extend
        if kv_written:  # only for backends that opted in (fuses_rotary_kv_write)
            return run(q, k, v, layer, batch, kv_written=True)
        return run(q, k, v, layer, batch)
