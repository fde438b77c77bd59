"""What rank 0 sends each forward so that every worker runs the same batch on its own pools.

A BatchMessage holds the ForwardBatch's host data (small CPU tensors) and the LoRA segment and
slot table; `unpack_batch` rebuilds the ForwardBatch on a worker's device against its pools, after
mirroring rank 0's req_to_token writes for the batch's new tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from backplane.executor.batch import ForwardBatch, ForwardMode

# Optional ForwardBatch tensors sent when set (host copies go as they are, device ones are copied).
OPTIONAL_FIELDS = ("extend_prefix_lens_cpu", "extend_seq_lens_cpu", "custom_mask", "mask_indptr", "logits_indices")
MIRRORED_MODES = (ForwardMode.EXTEND, ForwardMode.DECODE)


@dataclass
class BatchMessage:
    """A ForwardBatch without its pools: every tensor on the host.

    input_ids, positions, out_cache_loc: [num_tokens] int64; req_pool_indices: [batch_size] int64;
    seq_lens_cpu: [batch_size] int32; optional: the OPTIONAL_FIELDS of ForwardBatch.
    lora: a lora_sync.LoraMessage, or None for a base-only batch.
    """

    mode: str
    batch_size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens_cpu: torch.Tensor
    optional: dict[str, torch.Tensor] = field(default_factory=dict)
    return_logprob: bool = False
    capture_hidden: bool = False
    lora: Any = None
    # EXTEND: req_to_token[row, :prefix_len] of every request, request after request [sum prefix] int64;
    # a prefix from the radix cache was never part of a batch on the workers.
    prefix_slots: torch.Tensor | None = None


def _host(t: torch.Tensor, dtype=torch.int64) -> torch.Tensor:
    return t.to("cpu", dtype)


def pack_batch(batch: ForwardBatch, lora: Any = None) -> BatchMessage:
    """The host data of `batch` (rank 0, before its forward)."""
    if batch.forward_mode not in MIRRORED_MODES:
        raise NotImplementedError(
            f"tensor parallelism: expected a forward mode in {[m.value for m in MIRRORED_MODES]}, "
            f"got {batch.forward_mode.value!r} (speculative decoding is not supported with --tp-size > 1)"
        )
    optional = {}
    for name in OPTIONAL_FIELDS:
        value = getattr(batch, name)
        if value is not None:
            optional[name] = value.cpu()
    return BatchMessage(
        mode=batch.forward_mode.value, batch_size=batch.batch_size, input_ids=_host(batch.input_ids),
        positions=_host(batch.positions), out_cache_loc=_host(batch.out_cache_loc),
        req_pool_indices=_host(batch.req_pool_indices), seq_lens_cpu=_host(batch.seq_lens_cpu, torch.int32),
        optional=optional, return_logprob=batch.return_logprob, capture_hidden=batch.capture_hidden, lora=lora,
        prefix_slots=_prefix_slots(batch),
    )


def _prefix_slots(batch: ForwardBatch) -> torch.Tensor | None:
    prefix = batch.extend_prefix_lens_cpu
    if batch.forward_mode != ForwardMode.EXTEND or prefix is None or int(prefix.sum()) == 0:
        return None
    r2t, rows = batch.req_to_token_pool.req_to_token, batch.req_pool_indices.tolist()
    return torch.cat([r2t[row, :n].to("cpu", torch.int64) for row, n in zip(rows, prefix.tolist())])


def new_token_counts(msg: BatchMessage) -> torch.Tensor:
    """[batch_size] int64: new tokens per request (extend lengths, or the same count for all)."""
    lens = msg.optional.get("extend_seq_lens_cpu")
    if lens is not None:
        return lens.to(torch.int64)
    return torch.full((msg.batch_size,), msg.input_ids.numel() // max(msg.batch_size, 1), dtype=torch.int64)


def mirror_req_to_token(msg: BatchMessage, req_to_token: torch.Tensor) -> None:
    """Repeat rank 0's writes: req_to_token[row, position] = slot for every new token.

    In EXTEND and DECODE a token's position is its index in the request, which is where the
    scheduler recorded its slot (see ForwardBatch).
    """
    rows = torch.repeat_interleave(msg.req_pool_indices, new_token_counts(msg))  # [num_tokens]
    device = req_to_token.device
    if msg.prefix_slots is not None:
        prefix = msg.optional["extend_prefix_lens_cpu"].to(torch.int64)
        prefix_rows = torch.repeat_interleave(msg.req_pool_indices, prefix)
        cols = torch.cat([torch.arange(n) for n in prefix.tolist()])
        req_to_token[prefix_rows.to(device), cols.to(device)] = msg.prefix_slots.to(device, torch.int32)
    req_to_token[rows.to(device), msg.positions.to(device)] = msg.out_cache_loc.to(device, torch.int32)


def unpack_batch(msg: BatchMessage, req_to_token_pool: Any, token_to_kv_pool: Any,
                 device: torch.device) -> ForwardBatch:
    """The ForwardBatch of `msg` on `device` over this rank's pools (req_to_token mirrored first)."""
    mirror_req_to_token(msg, req_to_token_pool.req_to_token)

    def dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    batch = ForwardBatch(
        forward_mode=ForwardMode(msg.mode), batch_size=msg.batch_size, input_ids=dev(msg.input_ids),
        positions=dev(msg.positions), req_pool_indices=dev(msg.req_pool_indices),
        seq_lens=dev(msg.seq_lens_cpu), seq_lens_cpu=msg.seq_lens_cpu, out_cache_loc=dev(msg.out_cache_loc),
        req_to_token_pool=req_to_token_pool, token_to_kv_pool=token_to_kv_pool,
        return_logprob=msg.return_logprob, capture_hidden=msg.capture_hidden,
    )
    for name, value in msg.optional.items():
        setattr(batch, name, value if name.endswith("_cpu") else dev(value))
    for name in ("extend_prefix_lens", "extend_seq_lens"):
        host = msg.optional.get(name + "_cpu")
        if host is not None:
            setattr(batch, name, dev(host))
    return batch
