"""ForwardMode and ForwardBatch: what one forward pass of the model runner receives.

A ForwardBatch carries device tensors for the kernels and host copies of the small per-request
vectors so that backends can plan on the host without a device synchronisation.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch

if TYPE_CHECKING:
    from backplane.contracts.memory import ReqToTokenPool, TokenToKVPool


@dataclass
class HostBatch:
    """The host copies of a ForwardBatch's token and request vectors, kept by the batch builder.

    input_ids, positions, out_cache_loc: [num_tokens] int64; req_pool_indices: [batch_size] int64.
    input_ids are the ids as built: a token still in flight under overlap scheduling is its
    negative placeholder (the device copy is resolved, this one is not). prefix_parts: EXTEND
    only, (slot tensors, prefix length) of each request with a cached prefix, from the host record
    `req.slots`; `prefix_slots` joins them only when asked (tensor parallelism), so a single-device
    prefill pays nothing for it. Reading these never waits for the device, which is why tensor
    parallelism sends them (backplane.distributed.batch_sync).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    prefix_parts: list[tuple[list[torch.Tensor], int]] = field(default_factory=list)

    @property
    def prefix_slots(self) -> torch.Tensor | None:
        """[sum prefix] int64: req_to_token[row, :prefix_len] of every request with a prefix, request
        after request, or None when none has one."""
        parts = [torch.cat(slots)[:n] for slots, n in self.prefix_parts]
        return torch.cat(parts) if parts else None

    @property
    def has_placeholders(self) -> bool:
        """Whether some input id is a placeholder for a token still on the device."""
        return bool(self.input_ids.numel()) and int(self.input_ids.min()) < 0


class ForwardMode(enum.Enum):
    """The kind of forward pass; attention backends declare which ones they serve."""

    EXTEND = "extend"  # prefill: new tokens attend to a cached prefix and causally to each other
    DECODE = "decode"  # one new token per request
    TARGET_VERIFY = "target_verify"  # draft tokens checked by the target model under a tree mask
    DRAFT_EXTEND = "draft_extend"  # the draft model extends over the accepted tokens

    @property
    def is_extend_like(self) -> bool:
        """Modes served by `AttentionBackend.forward_extend`."""
        return self in (ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND)

    @property
    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


@dataclass
class ForwardBatch:
    """One forward pass over `batch_size` requests.

    Token-level tensors are flattened over the batch in request order:
      input_ids, positions, out_cache_loc: [num_tokens]
    Request-level tensors:
      req_pool_indices: [batch_size] int64, the request's row in `req_to_token_pool`
      seq_lens: [batch_size] int32, the total length after this pass (prefix + new tokens)
      extend_prefix_lens / extend_seq_lens: [batch_size] int32, tokens already cached / new now
    The scheduler writes `req_to_token[req, prefix:prefix+new] = out_cache_loc[...]` before the
    forward, so a backend may read every key of a request through `req_to_token`. Backends write
    the new K/V at `out_cache_loc` themselves.

    For TARGET_VERIFY (and any extend with `custom_mask`): `custom_mask` is a flat bool tensor
    holding, request after request, a row-major [extend_len, seq_len] mask over all keys of the
    request (prefix included); `mask_indptr` [batch_size + 1] gives where each request starts.
    """

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    out_cache_loc: torch.Tensor
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: TokenToKVPool
    extend_prefix_lens: torch.Tensor | None = None
    extend_seq_lens: torch.Tensor | None = None
    extend_prefix_lens_cpu: torch.Tensor | None = None
    extend_seq_lens_cpu: torch.Tensor | None = None
    custom_mask: torch.Tensor | None = None
    mask_indptr: torch.Tensor | None = None
    spec_info: Any = None
    lora_info: Any = None
    return_logprob: bool = False
    # Which tokens' hidden states go to the logits layer (default: the last of each request).
    logits_indices: torch.Tensor | None = None
    # Set by the model runner while a CUDA graph is captured or replayed.
    graph_key: Any = None
    # The model returns the last layer's hidden states too (EAGLE drafts from them).
    capture_hidden: bool = False
    # A caller-owned fp32 [rows >= selected tokens, vocab] the logits layer writes into (graph capture).
    logits_out: torch.Tensor | None = None
    # The builder's host copies (None for batches built elsewhere: graph capture, speculation).
    host: HostBatch | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def set_extend_lens(self, prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> None:
        """Set extend_prefix_lens / extend_seq_lens ([batch_size] int32) and their host copies."""
        self.extend_prefix_lens_cpu = torch.tensor(prefix_lens, dtype=torch.int32)
        self.extend_seq_lens_cpu = torch.tensor(extend_lens, dtype=torch.int32)
        self.extend_prefix_lens = self.extend_prefix_lens_cpu.to(self.device, non_blocking=True)
        self.extend_seq_lens = self.extend_seq_lens_cpu.to(self.device, non_blocking=True)

    @property
    def tokens_per_request(self) -> int:
        """Decode and verify batches have the same number of new tokens in every request."""
        return self.num_tokens // max(self.batch_size, 1)
