"""Static buffers for CUDA graphs: bound at capture, refreshed in place before every replay.

A graph reads the capture batch's own tensors where the kernels can (`_bound`: the graph runner's
static buffers, which it rewrites before every replay), else buffers of its own; a replay copies
into what the graph reads only what is not already there (`_write`), so a replay of the runner's
padded batch makes no device operation for a decode or an extend graph.

A decode graph of batch size bs reads the request rows ([bs] int64) and seq_lens ([bs] int32), and
a view of the shared split scratch; its split count is fixed at capture from bs alone (the kernel
lowers it per request from the sequence length on the device). A TARGET_VERIFY graph reads a fixed qo_indptr
(tokens_per_request apart), prefix lengths derived from seq_lens at replay, and, when captured
with one, the custom mask copied into a buffer of max_num_tokens * max_context_len entries and the
tokens' positions (a windowed layer reads them under a tree mask). A
DRAFT_EXTEND graph with the same tokens in every request (an EAGLE draft window) is bound like a
verify graph without a mask (causal); verify and draft-window graphs read buffers of their own. An
EXTEND graph (a token bucket shared by requests of any lengths, `key.ragged`) reads the request
rows, qo_indptr (the padded batch's `extend_indptr`) and the prefix lengths; its grid covers the
whole bucket in every request (the kernel skips the blocks past a request's new tokens).
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
        # EXTEND graphs captured with a batch whose indptr the kernels cannot read (verify graphs keep
        # theirs from capture).
        self.extend_qo_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
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
            meta = self._decode_metadata(batch)
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
            _write(meta.req_pool_indices, batch.req_pool_indices)
            _write(meta.prefix_lens, batch.extend_prefix_lens)
            self._refresh_extend_indptr(meta.qo_indptr, batch)
            return meta
        _write(meta.req_pool_indices, batch.req_pool_indices)
        if isinstance(meta, DecodeMetadata):
            _write(meta.seq_lens, batch.seq_lens)
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

    def _decode_metadata(self, batch: ForwardBatch) -> DecodeMetadata:
        bs = batch.batch_size
        splits = self.splits_for_bs(bs)
        n = bs * self.num_heads * splits
        return DecodeMetadata(
            req_pool_indices=_bound(batch.req_pool_indices, self.req_pool_indices[:bs]),
            seq_lens=_bound(batch.seq_lens, self.seq_lens[:bs]),
            num_kv_splits=splits,
            attn_logits=self.attn_logits[: n * self.v_dim].view(bs, self.num_heads, splits, self.v_dim),
            attn_lse=self.attn_lse[:n].view(bs, self.num_heads, splits),
        )

    def _extend_metadata(self, batch: ForwardBatch, bucket: int) -> ExtendMetadata:
        """Requests of any lengths sharing `bucket` tokens: the grid spans the whole bucket."""
        _check_extend_lens(batch)
        bs = batch.batch_size
        return ExtendMetadata(
            req_pool_indices=_bound(batch.req_pool_indices, self.req_pool_indices[:bs]),
            qo_indptr=_bound(batch.extend_indptr, self.extend_qo_indptr[: bs + 1]),
            prefix_lens=_bound(batch.extend_prefix_lens, self.prefix_lens[:bs]),
            max_q_len=bucket,
        )

    @staticmethod
    def _refresh_extend_indptr(qo_indptr: torch.Tensor, batch: ForwardBatch) -> None:
        """An extend graph's qo_indptr [bs + 1] (its first entry always 0): the batch's
        `extend_indptr` (nothing to do when it is the one bound), else the running sum of its
        extend lengths, on the host when it has them (one copy of a fresh pageable tensor, staged
        before the copy returns)."""
        bs, new = batch.batch_size, batch.extend_seq_lens_cpu
        if batch.extend_indptr is not None:
            _write(qo_indptr, batch.extend_indptr)
        elif new is None:
            torch.cumsum(batch.extend_seq_lens, 0, out=qo_indptr[1 : bs + 1])
        else:
            host = torch.zeros(bs + 1, dtype=torch.int32)
            torch.cumsum(new, 0, dtype=torch.int32, out=host[1:])
            qo_indptr.copy_(host, non_blocking=True)

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


def _bound(tensor: torch.Tensor | None, own: torch.Tensor) -> torch.Tensor:
    """What a graph reads for `own`'s field: the capture batch's `tensor` itself when the kernels can
    read it as they would `own` (same dtype, shape and device, contiguous), else `own`.

    NOTE: the graph then reads `tensor`'s memory at every replay, which the capture batch's owner
    (the graph runner: its static buffers) rewrites before each one; a replay with another tensor
    is copied into it (`_write`).
    """
    if (tensor is not None and tensor.dtype == own.dtype and tensor.shape == own.shape
            and tensor.device == own.device and tensor.is_contiguous()):
        return tensor
    return own


def _write(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src, unless src is dst (the tensor the graph was bound to): no device operation then."""
    if src.data_ptr() != dst.data_ptr() or src.dtype != dst.dtype or src.shape != dst.shape:
        dst.copy_(src)


def _check_extend_lens(batch: ForwardBatch) -> None:
    if batch.extend_seq_lens is None or batch.extend_prefix_lens is None:
        raise ValueError("triton attention graph: an extend graph's batch needs extend_seq_lens and "
                         "extend_prefix_lens (the graph runner's padded view has them)")

