"""Per-batch metadata of the triton backend and how it is derived from a ForwardBatch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backplane import ForwardBatch


@dataclass
class DecodeMetadata:
    """What the decode kernels read besides q and the pool.

    req_pool_indices: [bs]; seq_lens: [bs] int32 (the new token included)
    attn_logits: [bs, num_heads, >= num_kv_splits, v_dim] fp32 and attn_lse: [bs, num_heads,
    >= num_kv_splits] fp32, the split partials
    """

    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    num_kv_splits: int
    attn_logits: torch.Tensor
    attn_lse: torch.Tensor


@dataclass
class ExtendMetadata:
    """What the extend kernel reads besides q/k/v and the pool.

    qo_indptr: [bs + 1] int32 over the batch's new tokens; prefix_lens: [bs] int32
    custom_mask: flat bool, request b's [q_len, prefix + q_len] mask at mask_indptr[b] ([bs + 1] int64)
    positions: [num_tokens] int64, the new tokens' positions, set with a custom mask (a windowed
      layer reads them: a draft tree's node i is at num_cached + depth(i), not num_cached + i)
    max_q_len: the most new tokens of any request (the kernel grid)
    """

    req_pool_indices: torch.Tensor
    qo_indptr: torch.Tensor
    prefix_lens: torch.Tensor
    max_q_len: int
    custom_mask: torch.Tensor | None = None
    mask_indptr: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    # TARGET_VERIFY through the split-KV verify kernel (verify_kernel="split"): the splits, their
    # scratch ([num_tokens, num_heads, splits, v_dim] and [num_tokens, num_heads, splits] fp32) and
    # seq_lens [bs]; None when the extend kernel serves the batch.
    verify_splits: int | None = None
    attn_logits: torch.Tensor | None = None
    attn_lse: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None


def new_token_counts(batch: ForwardBatch) -> tuple[torch.Tensor, int]:
    """New tokens per request ([bs] int32 on the batch device) and their maximum, without a device sync.

    Batches without extend_seq_lens (decode, verify) have the same count in every request.
    """
    if batch.extend_seq_lens is None:
        per_request = batch.tokens_per_request
        counts = torch.full((batch.batch_size,), per_request, dtype=torch.int32, device=batch.device)
        return counts, per_request
    counts = batch.extend_seq_lens.to(torch.int32)
    host = batch.extend_seq_lens_cpu if batch.extend_seq_lens_cpu is not None else batch.extend_seq_lens.cpu()
    return counts, int(host.max()) if host.numel() else 0


def prefix_lengths(seq_lens: torch.Tensor, new_counts: torch.Tensor) -> torch.Tensor:
    """Cached tokens per request; clamped at 0 for graph padding (seq_len fill 1 < tokens per request)."""
    return (seq_lens.to(torch.int32) - new_counts).clamp_(min=0)


def exclusive_cumsum(counts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[n] -> [n + 1] starting at 0."""
    out = torch.zeros(counts.shape[0] + 1, dtype=dtype, device=counts.device)
    out[1:] = torch.cumsum(counts, 0)
    return out


def mask_row_counts(prefix_lens: torch.Tensor, new_counts: torch.Tensor) -> torch.Tensor:
    """Mask elements per request: q_len rows of prefix + q_len columns."""
    return new_counts.to(torch.int64) * (prefix_lens + new_counts).to(torch.int64)


def build_extend_metadata(batch: ForwardBatch) -> ExtendMetadata:
    counts, max_q_len = new_token_counts(batch)
    prefix = prefix_lengths(batch.seq_lens, counts)
    meta = ExtendMetadata(
        req_pool_indices=batch.req_pool_indices,
        qo_indptr=exclusive_cumsum(counts, torch.int32),
        prefix_lens=prefix,
        max_q_len=max_q_len,
    )
    if batch.custom_mask is not None:
        meta.custom_mask = batch.custom_mask
        meta.mask_indptr = batch.mask_indptr
        meta.positions = batch.positions
        if meta.mask_indptr is None:
            meta.mask_indptr = exclusive_cumsum(mask_row_counts(prefix, counts), torch.int64)
    return meta
