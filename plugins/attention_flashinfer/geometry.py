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
  masked         BatchPrefill paged over all keys with the batch's custom mask; a sliding-window
                 layer's mask has the window folded in by position (`window_mask`) and is planned
                 with window_left=-1: FlashInfer counts the window by key index, and a draft
                 tree's node i sits at num_cached + depth(i), not num_cached + i
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask_buffer(self, window_left: int) -> torch.Tensor:
        """The packed-mask buffer of the masked wrappers of `window_left`: the layers without a window
        share `custom_mask`; each window has its own (its mask differs), allocated on first use."""
        if window_left < 0:
            return self.custom_mask
        if window_left not in self.window_masks:
            self.window_masks[window_left] = torch.zeros_like(self.custom_mask)
        return self.window_masks[window_left]

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
        self._window_masks: dict[int, torch.Tensor] = {}

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

    def mask_for(self, config: LayerConfig) -> torch.Tensor | None:
        """The custom mask the masked wrapper of `config` is planned with: the batch's, with a sliding
        window folded in by position (that wrapper plans window_left=-1)."""
        if self.custom_mask is None or config.window_left < 0:
            return self.custom_mask
        if config.window_left not in self._window_masks:
            self._window_masks[config.window_left] = window_mask(self.batch, self.custom_mask, self.query_lens_cpu,
                                                                 config.window_left + 1)
        return self._window_masks[config.window_left]

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


def window_mask(batch: ForwardBatch, custom_mask: torch.Tensor, query_lens_cpu: torch.Tensor,
                window: int) -> torch.Tensor:
    """`custom_mask` with a sliding window of `window` keys folded in by position: key j stays visible
    from query t only when pos(j) > pos(t) - window.

    custom_mask: flat bool, request after request a row-major [q_len, seq_len] block (`_flat_custom_mask`);
    query_lens_cpu: [batch_size] host. A request's cached prefix keys are at positions 0..prefix-1,
    its new keys (the queries, in order) at `batch.positions`. Device work only: the per-token lengths
    are built on the host and copied once; no host synchronisation. Returns a bool tensor like custom_mask.
    """
    device = custom_mask.device
    q_lens = query_lens_cpu.long()
    seq = batch.seq_lens_cpu[: q_lens.numel()].long()
    q_start = torch.cumsum(q_lens, 0) - q_lens
    # per query token: its request's seq_len, prefix length and first query token
    per_token = torch.stack([torch.repeat_interleave(x, q_lens) for x in (seq, seq - q_lens, q_start)])
    seq_t, prefix_t, start_t = per_token.to(device, non_blocking=True)
    num_tokens, total = int(q_lens.sum()), custom_mask.numel()
    positions = batch.positions[:num_tokens].to(torch.int64)
    # per mask entry: its query token (row) and key index (column)
    row = torch.repeat_interleave(torch.arange(num_tokens, device=device), seq_t, output_size=total)
    col = torch.arange(total, device=device) - (torch.cumsum(seq_t, 0) - seq_t)[row]
    prefix = prefix_t[row]
    new_key = (start_t[row] + col - prefix).clamp_(0, max(num_tokens - 1, 0))
    key_pos = torch.where(col < prefix, col, positions[new_key])
    return custom_mask & (key_pos > positions[row] - window)
