"""What one forward pass looks like to FlashInfer: query layout, key spans, and the route per layer.

A route names the kernels that serve one layer configuration in one forward mode:
  decode         BatchDecode over all keys (DECODE)
  ragged         BatchPrefill ragged, causal, over the new tokens only (EXTEND without any prefix)
  ragged+prefix  ragged causal over the new tokens + paged non-causal over the cached prefix,
                 merged through their log-sum-exps (EXTEND with a prefix)
  paged          BatchPrefill paged, causal, over all keys (TARGET_VERIFY / DRAFT_EXTEND without a
                 mask, sliding-window layers of an EXTEND with a prefix: the split above
                 would place the window relative to the prefix, not the query, and every EXTEND
                 inside a CUDA graph: the new keys are in the pool before attention runs)
  masked         BatchPrefill paged over all keys with the batch's custom mask
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backplane.attention import AttentionLayerInfo
from backplane import ForwardBatch, ForwardMode
from backplane.plugins.attention_flashinfer.indices import KvSpan, indptr_from_lens, make_span

DECODE, RAGGED, RAGGED_PREFIX, PAGED, MASKED = "decode", "ragged", "ragged+prefix", "paged", "masked"


@dataclass(frozen=True)
class LayerConfig:
    """What FlashInfer bakes into a plan besides the batch; layers that share it share a plan.

    window_left: FlashInfer's inclusive left window (sliding_window - 1), -1 for none.
    """

    window_left: int
    logits_soft_cap: float
    sm_scale: float

    @classmethod
    def of(cls, layer: AttentionLayerInfo) -> LayerConfig:
        window_left = layer.sliding_window - 1 if layer.sliding_window > 0 else -1
        return cls(window_left, float(layer.logit_softcap), float(layer.scaling))


@dataclass
class GraphBuffers:
    """Caller-owned buffers that captured FlashInfer kernels read; plan() refreshes them in place.

    kv_indptr, qo_indptr, mask_indptr: [max_bs + 1] int32; last_page_len: [max_bs] int32 ones;
    kv_indices: [max_bs * max_context_len] int32; custom_mask: packed bits (uint8) of the masks of
    max_num_tokens queries over max_context_len keys.
    """

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    last_page_len: torch.Tensor
    qo_indptr: torch.Tensor
    custom_mask: torch.Tensor
    mask_indptr: torch.Tensor

    @classmethod
    def allocate(cls, max_bs: int, max_num_tokens: int, max_context_len: int, device) -> GraphBuffers:
        def ints(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=device)

        mask_bytes = (max_num_tokens * max_context_len + 7) // 8 + max_bs  # + per-request rounding
        return cls(
            kv_indptr=ints(max_bs + 1),
            kv_indices=ints(max_bs * max_context_len),
            last_page_len=torch.ones(max_bs, dtype=torch.int32, device=device),
            qo_indptr=ints(max_bs + 1),
            custom_mask=torch.zeros(mask_bytes, dtype=torch.uint8, device=device),
            mask_indptr=ints(max_bs + 1),
        )


class ForwardGeometry:
    """Host-side layout of one batch plus its key spans (built on first use, on the device)."""

    def __init__(self, batch: ForwardBatch, buffers: GraphBuffers | None = None):
        self.batch = batch
        self.mode = batch.forward_mode
        self.buffers = buffers
        self.query_lens_cpu = _query_lens_cpu(batch)
        self.qo_indptr_cpu = indptr_from_lens(self.query_lens_cpu)
        self.custom_mask = _flat_custom_mask(batch, self.query_lens_cpu)
        # Verify batches and draft extends without extend lengths: every request has as many queries.
        uniform = self.mode is ForwardMode.TARGET_VERIFY or (
            self.mode is ForwardMode.DRAFT_EXTEND and batch.extend_seq_lens is None and batch.extend_seq_lens_cpu is None)
        self.uniform_q_len = batch.tokens_per_request if uniform else None
        self._prefix_lens_cpu = _prefix_lens_cpu(batch, self.query_lens_cpu)
        self.has_prefix = self.mode is ForwardMode.EXTEND and bool((self._prefix_lens_cpu > 0).any())
        self._spans: dict[str, KvSpan] = {}

    def route(self, config: LayerConfig) -> str:
        if self.mode.is_decode:
            return DECODE
        if self.custom_mask is not None:
            return MASKED
        if self.mode is not ForwardMode.EXTEND or self.buffers is not None:
            return PAGED
        if not self.has_prefix:
            return RAGGED
        return RAGGED_PREFIX if config.window_left < 0 else PAGED

    @property
    def full(self) -> KvSpan:
        """All keys of every request (prefix and new tokens): seq_lens."""
        return self._span("full", self.batch.seq_lens_cpu)

    @property
    def prefix(self) -> KvSpan:
        """The cached prefix of every request only (EXTEND)."""
        assert self.buffers is None, "graph-captured batches never split off the prefix"
        return self._span("prefix", self._prefix_lens_cpu)

    def _span(self, name: str, kv_lens_cpu: torch.Tensor) -> KvSpan:
        if name not in self._spans:
            buffers = self.buffers
            self._spans[name] = make_span(
                self.batch.req_to_token_pool.req_to_token,
                self.batch.req_pool_indices,
                kv_lens_cpu,
                indptr_buffer=buffers.kv_indptr if buffers is not None else None,
                indices_buffer=buffers.kv_indices if buffers is not None else None,
            )
        return self._spans[name]


def _query_lens_cpu(batch: ForwardBatch) -> torch.Tensor:
    """[batch_size] int32 host: the new tokens of each request."""
    bs, mode = batch.batch_size, batch.forward_mode
    if mode.is_decode:
        lens = torch.ones(bs, dtype=torch.int32)
    elif mode is ForwardMode.TARGET_VERIFY or (batch.extend_seq_lens_cpu is None and batch.extend_seq_lens is None):
        lens = torch.full((bs,), batch.tokens_per_request, dtype=torch.int32)
    elif batch.extend_seq_lens_cpu is not None:
        lens = batch.extend_seq_lens_cpu.to(torch.int32)
    else:
        lens = batch.extend_seq_lens.to("cpu", torch.int32)  # NOTE: synchronises; pass extend_seq_lens_cpu
    if int(lens.sum()) != batch.num_tokens:
        raise ValueError(
            f"flashinfer attention ({mode.value}): expected the new tokens of the {bs} requests to add up "
            f"to num_tokens={batch.num_tokens}, got {lens.tolist()}"
        )
    return lens


def _prefix_lens_cpu(batch: ForwardBatch, query_lens_cpu: torch.Tensor) -> torch.Tensor:
    if batch.extend_prefix_lens_cpu is not None:
        return batch.extend_prefix_lens_cpu.to(torch.int32)
    return batch.seq_lens_cpu.to(torch.int32) - query_lens_cpu


def _flat_custom_mask(batch: ForwardBatch, query_lens_cpu: torch.Tensor) -> torch.Tensor | None:
    """batch.custom_mask cut to sum(extend_len * seq_len) bool entries, or None without a mask."""
    if batch.custom_mask is None or batch.forward_mode.is_decode:
        return None
    needed = int((query_lens_cpu.long() * batch.seq_lens_cpu.long()).sum())
    mask = batch.custom_mask.view(-1)
    if mask.numel() < needed:
        raise ValueError(
            f"custom_mask: expected at least {needed} entries (a row-major [extend_len, seq_len] block "
            f"per request), got {mask.numel()}"
        )
    mask = mask[:needed]
    return mask if mask.dtype == torch.bool else mask.bool()
