"""Static buffers for CUDA graphs: bound at capture, refreshed in place before every replay.

A decode graph of batch size bs reads req_pool_indices[:bs], seq_lens[:bs] and a view of the
shared split scratch; its split count is fixed at capture from bs alone (the kernel lowers it per
request from the sequence length on the device). A TARGET_VERIFY graph reads a fixed qo_indptr
(tokens_per_request apart), prefix lengths derived from seq_lens at replay, and, when captured
with one, the custom mask copied into a buffer of max_num_tokens * max_context_len entries and the
tokens' positions (a windowed layer reads them under a tree mask). A
DRAFT_EXTEND graph with the same tokens in every request (an EAGLE draft window) is bound like a
verify graph without a mask (causal). An EXTEND graph (a token bucket shared by requests of any
lengths, `key.ragged`) reads its own qo_indptr and prefix lengths, rewritten from the padded
batch's host extend lengths at every replay in one copy (the two are rows of one buffer), and the
capture batch's request rows themselves: the graph runner's static buffer, which it rewrites before
every replay (copied only when a replay's batch has another); its grid covers the whole bucket in
every request (the kernel skips the blocks past a request's new tokens).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from backplane import ForwardBatch, ForwardMode

from .metadata import DecodeMetadata, ExtendMetadata, exclusive_cumsum, mask_row_counts, prefix_lengths


def _uniform_draft_extend(batch: ForwardBatch) -> bool:
    return batch.forward_mode is ForwardMode.DRAFT_EXTEND and batch.extend_seq_lens is None


class GraphBuffers:
    """Every tensor a captured graph of this backend reads, plus the metadata of each graph key."""

    def __init__(self, max_bs: int, max_num_tokens: int, num_heads: int, v_dim: int,
                 max_context_len: int, splits_for_bs: Callable[[int], int], device: torch.device,
                 split_verify: Callable[[int], bool] = lambda tokens_per_request: False):
        self.max_bs, self.max_num_tokens, self.max_context_len = max_bs, max_num_tokens, max_context_len
        self.num_heads, self.v_dim, self.splits_for_bs = num_heads, v_dim, splits_for_bs
        self.req_pool_indices = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=device)
        self.prefix_lens = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.qo_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
        self.mask_indptr = torch.zeros(max_bs + 1, dtype=torch.int64, device=device)
        # EXTEND graphs: their own indptr and prefix lengths (verify graphs keep theirs from capture),
        # the rows of one buffer that a replay writes in one copy.
        self.extend_lens = torch.zeros((2, max_bs + 1), dtype=torch.int32, device=device)
        self.extend_qo_indptr = self.extend_lens[0]
        self.extend_prefix_lens = self.extend_lens[1, :max_bs]
        self.ragged: set[Any] = set()
        self.custom_mask: torch.Tensor | None = None  # allocated by the first verify capture with a mask
        self.positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)  # verify with a mask
        rows = max(bs * splits_for_bs(bs) for bs in range(1, max_bs + 1))
        # Split partials, shared by every decode graph (graphs never run concurrently).
        self.attn_logits = torch.empty(rows * num_heads * v_dim, dtype=torch.float32, device=device)
        self.attn_lse = torch.empty(rows * num_heads, dtype=torch.float32, device=device)
        self.metadata: dict[Any, DecodeMetadata | ExtendMetadata] = {}
        # Split partials of verify graphs that take the split-KV verify kernel (allocated at their first capture).
        self.split_verify = split_verify
        self.verify_logits: torch.Tensor | None = None
        self.verify_lse: torch.Tensor | None = None

    def capture(self, key: Any, batch: ForwardBatch) -> DecodeMetadata | ExtendMetadata:
        bs = batch.batch_size
        if bs > self.max_bs:
            raise ValueError(f"triton attention graph: expected batch size <= {self.max_bs}, got {bs}")
        if getattr(key, "ragged", False) and batch.forward_mode is ForwardMode.EXTEND:
            meta = self._extend_metadata(batch, key.num_tokens)
            self.ragged.add(key)
        elif batch.forward_mode is ForwardMode.DECODE:
            meta = self._decode_metadata(bs)
        elif batch.forward_mode is ForwardMode.TARGET_VERIFY or _uniform_draft_extend(batch):
            meta = self._verify_metadata(batch)
        else:
            raise ValueError(
                "triton attention graph: expected mode decode, target_verify, draft_extend with the same "
                "number of tokens in every request (no extend_seq_lens), or extend under a token-bucket key, "
                f"got {batch.forward_mode.value}"
            )
        self.metadata[key] = meta
        self.refresh(key, batch)
        return meta

    def refresh(self, key: Any, batch: ForwardBatch) -> DecodeMetadata | ExtendMetadata:
        meta = self.metadata[key]
        bs = batch.batch_size
        if key in self.ragged:
            _check_extend_lens(batch)
            self._refresh_extend_lens(batch)
            if batch.req_pool_indices.data_ptr() != meta.req_pool_indices.data_ptr():
                meta.req_pool_indices.copy_(batch.req_pool_indices)
            return meta
        self.req_pool_indices[:bs].copy_(batch.req_pool_indices)
        if isinstance(meta, DecodeMetadata):
            self.seq_lens[:bs].copy_(batch.seq_lens)
            return meta
        per_request = meta.max_q_len
        self.prefix_lens[:bs].copy_(prefix_lengths(batch.seq_lens, per_request))
        if meta.verify_splits is not None:
            self.seq_lens[:bs].copy_(batch.seq_lens)
        if meta.custom_mask is not None:
            self._refresh_mask(batch, per_request)
        elif batch.custom_mask is not None:
            raise ValueError("triton attention graph: captured without a custom mask, replayed with one")
        return meta

    def _decode_metadata(self, bs: int) -> DecodeMetadata:
        splits = self.splits_for_bs(bs)
        n = bs * self.num_heads * splits
        return DecodeMetadata(
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            num_kv_splits=splits,
            attn_logits=self.attn_logits[: n * self.v_dim].view(bs, self.num_heads, splits, self.v_dim),
            attn_lse=self.attn_lse[:n].view(bs, self.num_heads, splits),
        )

    def _extend_metadata(self, batch: ForwardBatch, bucket: int) -> ExtendMetadata:
        """Requests of any lengths sharing `bucket` tokens: the grid spans the whole bucket. The
        request rows are the capture batch's own tensor when the kernels can read it (int64,
        contiguous): the graph runner's static buffer, which a replay of the runner's padded batch
        need not copy."""
        _check_extend_lens(batch)
        bs, rows = batch.batch_size, batch.req_pool_indices
        return ExtendMetadata(
            req_pool_indices=rows if rows.dtype == torch.int64 and rows.is_contiguous() else self.req_pool_indices[:bs],
            qo_indptr=self.extend_qo_indptr[: bs + 1],
            prefix_lens=self.extend_prefix_lens[:bs],
            max_q_len=bucket,
        )

    def _refresh_extend_lens(self, batch: ForwardBatch) -> None:
        """qo_indptr and prefix lengths of an extend graph: built on the host from the batch's host
        extend lengths and written with one copy of both rows (a fresh pageable tensor, staged
        before the copy returns), else from its device ones."""
        bs, new, prefix = batch.batch_size, batch.extend_seq_lens_cpu, batch.extend_prefix_lens_cpu
        if new is None or prefix is None:
            torch.cumsum(batch.extend_seq_lens, 0, out=self.extend_qo_indptr[1 : bs + 1])
            self.extend_prefix_lens[:bs].copy_(batch.extend_prefix_lens)
            return
        host = torch.zeros(self.extend_lens.shape, dtype=torch.int32)
        torch.cumsum(new, 0, out=host[0, 1 : bs + 1])
        host[1, :bs] = prefix
        self.extend_lens.copy_(host, non_blocking=True)

    def _verify_metadata(self, batch: ForwardBatch) -> ExtendMetadata:
        bs, per_request = batch.batch_size, batch.tokens_per_request
        counts = torch.full((bs,), per_request, dtype=torch.int32, device=self.qo_indptr.device)
        self.qo_indptr[: bs + 1].copy_(exclusive_cumsum(counts, torch.int32))
        meta = ExtendMetadata(
            req_pool_indices=self.req_pool_indices[:bs],
            qo_indptr=self.qo_indptr[: bs + 1],
            prefix_lens=self.prefix_lens[:bs],
            max_q_len=per_request,
        )
        if self.split_verify(per_request):
            self._add_verify_scratch(meta, bs, per_request)
        if batch.custom_mask is not None:
            if self.custom_mask is None:
                size = self.max_num_tokens * self.max_context_len
                self.custom_mask = torch.zeros(size, dtype=torch.bool, device=self.qo_indptr.device)
            meta.custom_mask = self.custom_mask
            meta.mask_indptr = self.mask_indptr[: bs + 1]
            meta.positions = self.positions[: bs * per_request]
        return meta

    def _add_verify_scratch(self, meta: ExtendMetadata, bs: int, per_request: int) -> None:
        """Views of the verify split partials for a graph of batch size bs (splits fixed by bs)."""
        if self.verify_logits is None:
            rows = per_request * max(b * self.splits_for_bs(b) for b in range(1, self.max_bs + 1))
            self.verify_logits = torch.empty(rows * self.num_heads * self.v_dim, dtype=torch.float32,
                                             device=self.seq_lens.device)
            self.verify_lse = torch.empty(rows * self.num_heads, dtype=torch.float32, device=self.seq_lens.device)
        splits, tokens = self.splits_for_bs(bs), bs * per_request
        n = tokens * self.num_heads * splits
        if n > self.verify_lse.numel():
            raise ValueError(f"triton attention graph: verify graphs of {per_request} tokens a request were sized "
                             f"for fewer rows than batch size {bs} needs")
        meta.verify_splits, meta.seq_lens = splits, self.seq_lens[:bs]
        meta.attn_logits = self.verify_logits[: n * self.v_dim].view(tokens, self.num_heads, splits, self.v_dim)
        meta.attn_lse = self.verify_lse[:n].view(tokens, self.num_heads, splits)

    def _refresh_mask(self, batch: ForwardBatch, per_request: int) -> None:
        if batch.custom_mask is None:
            raise ValueError("triton attention graph: captured with a custom mask, replayed without one")
        n = batch.custom_mask.numel()
        if n > self.custom_mask.numel():
            raise ValueError(
                f"triton attention graph: expected a custom mask of at most {self.custom_mask.numel()} "
                f"entries (max_num_tokens * max_context_len), got {n}"
            )
        bs = batch.batch_size
        self.custom_mask[:n].copy_(batch.custom_mask)
        num_tokens = min(batch.positions.shape[0], bs * per_request)
        self.positions[:num_tokens].copy_(batch.positions[:num_tokens])
        self.positions[num_tokens : bs * per_request].zero_()  # padded tokens (position 0, as the runner pads)
        counts = torch.full((bs,), per_request, dtype=torch.int32, device=self.mask_indptr.device)
        rows = mask_row_counts(self.prefix_lens[:bs], counts)
        self.mask_indptr[1 : bs + 1].copy_(torch.cumsum(rows, 0))


def _check_extend_lens(batch: ForwardBatch) -> None:
    if batch.extend_seq_lens is None or batch.extend_prefix_lens is None:
        raise ValueError("triton attention graph: an extend graph's batch needs extend_seq_lens and "
                         "extend_prefix_lens (the graph runner's padded view has them)")

