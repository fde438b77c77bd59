"""What rank 0 sends each forward so that every worker runs the same batch on its own pools.

A BatchMessage is built from host data only: the batch builder's host copies (`batch.host`), the
host length vectors and the batch's `plugin_inputs` (what scheduler participants describe of it,
host data by contract: LoRA's segments and slot table ride there, shipped as they are; each
participant's graph contributor on the worker makes its binding from them). Reading a device tensor back would wait
for the step in flight and undo overlap scheduling, so `pack_batch` never does.

Under overlap scheduling a decode batch's input ids hold placeholders (-k) for tokens sampled on
rank 0's device and not yet read on any host. The message carries them as they are, and the
resolved ids follow on the device: `send_input_ids` broadcasts rank 0's resolved `input_ids` over
the tensor group (NCCL in stream order on GPU, so no host waits), and `receive_input_ids` is the
worker's side. Rank 0's draw is then the only one: outputs are exact for greedy and seeded
sampling alike, which sampling again on every rank would give only with bit-identical full logits
on every rank and every request's generator state mirrored there (see docs/performance.md,
"Overlap scheduling").

`unpack_batch` rebuilds the ForwardBatch on a worker's device against its pools, after mirroring
rank 0's req_to_token writes for the batch's new tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from backplane.contracts.batch import ForwardBatch, ForwardMode

# Optional ForwardBatch tensors sent when set. The *_cpu ones are host copies; the others are
# device tensors the scheduler never sets (tests' forwards set logits_indices; custom_mask and
# mask_indptr belong to speculative decoding, which tensor parallelism refuses): they are copied.
OPTIONAL_FIELDS = ("extend_prefix_lens_cpu", "extend_seq_lens_cpu", "custom_mask", "mask_indptr", "logits_indices")
MIRRORED_MODES = (ForwardMode.EXTEND, ForwardMode.DECODE)


@dataclass
class BatchMessage:
    """A ForwardBatch without its pools: every tensor on the host.

    input_ids, positions, out_cache_loc: [num_tokens] int64; req_pool_indices: [batch_size] int64;
    seq_lens_cpu: [batch_size] int32; optional: the OPTIONAL_FIELDS of ForwardBatch.
    input_ids may hold placeholders (< 0); then `ids_follow` is True and the resolved ids come by
    a device broadcast right after the message (`receive_input_ids`).
    plugin_inputs: the batch's `plugin_inputs`, as they are. use_graph: whether the ranks may
    replay a captured graph (False: rank 0 runs this forward eagerly, and so does every rank).
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
    plugin_inputs: dict[str, Any] = field(default_factory=dict)
    use_graph: bool = True
    # A prefill (EXTEND, or DECODE for one-token prefills): req_to_token[row, :prefix_len] of every
    # request, request after request [sum prefix] int64; a prefix from the radix cache was never part
    # of a batch on the workers. Prefix lengths: extend_prefix_lens_cpu, or seq_lens - 1 in DECODE.
    prefix_slots: torch.Tensor | None = None
    ids_follow: bool = False


def pack_batch(batch: ForwardBatch, use_graph: bool = True) -> BatchMessage:
    """The host data of `batch` (rank 0, before its forward); reads no device tensor.

    `batch` must come from the batch builder (backplane.scheduler.batch_builder), whose host copies
    (`batch.host`) it sends.
    """
    if batch.forward_mode not in MIRRORED_MODES:
        raise NotImplementedError(
            f"tensor parallelism: expected a forward mode in {[m.value for m in MIRRORED_MODES]}, "
            f"got {batch.forward_mode.value!r} (speculative decoding is not supported with --tp-size > 1)"
        )
    host = batch.host
    if host is None:
        raise ValueError("tensor parallelism: expected a batch from the batch builder with host copies "
                         "(ForwardBatch.host), got one without; build it with build_extend_batch or build_decode_batch")
    return BatchMessage(
        mode=batch.forward_mode.value, batch_size=batch.batch_size, input_ids=_own(host.input_ids),
        positions=_own(host.positions), out_cache_loc=_own(host.out_cache_loc),
        req_pool_indices=_own(host.req_pool_indices), seq_lens_cpu=_own(batch.seq_lens_cpu.to(torch.int32)),
        optional=_optional(batch), return_logprob=batch.return_logprob, plugin_inputs=dict(batch.plugin_inputs),
        prefix_slots=host.prefix_slots, use_graph=use_graph,
        ids_follow=host.has_placeholders,
    )


def _own(t: torch.Tensor) -> torch.Tensor:
    """A host tensor with a storage of its own size. NOTE: a view (the builder's host copies are
    views of one packed tensor) pickles its whole base storage, once per view."""
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()


def _optional(batch: ForwardBatch) -> dict[str, torch.Tensor]:
    """The OPTIONAL_FIELDS that are set, on the host (host copies as they are)."""
    out = {}
    for name in OPTIONAL_FIELDS:
        value = getattr(batch, name)
        if value is not None:
            out[name] = value if name.endswith("_cpu") else value.cpu()
    return out


def send_input_ids(msg: BatchMessage, batch: ForwardBatch, group: Any = None) -> None:
    """rank 0, right after broadcasting `msg`: when its ids hold placeholders, broadcast the
    resolved device `batch.input_ids` [num_tokens] int64 over the tensor group (no host wait)."""
    if msg.ids_follow:
        torch.distributed.broadcast(batch.input_ids, src=0, group=group)


def receive_input_ids(msg: BatchMessage, device: torch.device, group: Any = None) -> torch.Tensor:
    """A worker's device input ids [num_tokens] int64 of `msg`: rank 0's resolved ids when they
    follow by broadcast (`send_input_ids`), else the message's own."""
    if not msg.ids_follow:
        return _dev(msg.input_ids, device)
    ids = torch.empty(msg.input_ids.shape, dtype=torch.int64, device=device)
    torch.distributed.broadcast(ids, src=0, group=group)
    return ids


def new_token_counts(msg: BatchMessage) -> torch.Tensor:
    """[batch_size] int64: new tokens per request (extend lengths, or the same count for all)."""
    lens = msg.optional.get("extend_seq_lens_cpu")
    if lens is not None:
        return lens.to(torch.int64)
    return torch.full((msg.batch_size,), msg.input_ids.numel() // max(msg.batch_size, 1), dtype=torch.int64)


def mirror_req_to_token(msg: BatchMessage, req_to_token: torch.Tensor) -> None:
    """Repeat rank 0's writes: req_to_token[row, position] = slot for every new token.

    In EXTEND and DECODE a token's position is its index in the request, which is where the
    scheduler recorded its slot (see ForwardBatch). Every copy is non-blocking: a blocking one
    would make this worker's host wait for its step in flight, and rank 0's next collective with it.
    """
    rows = torch.repeat_interleave(msg.req_pool_indices, new_token_counts(msg))  # [num_tokens]
    device = req_to_token.device
    if msg.prefix_slots is not None:  # a prefill's cached prefixes (DECODE: a prefill of one token each)
        prefix = msg.optional.get("extend_prefix_lens_cpu", msg.seq_lens_cpu - 1).to(torch.int64)
        prefix_rows = torch.repeat_interleave(msg.req_pool_indices, prefix)
        cols = torch.cat([torch.arange(n) for n in prefix.tolist()])
        req_to_token[_dev(prefix_rows, device), _dev(cols, device)] = _dev(msg.prefix_slots, device, torch.int32)
    req_to_token[_dev(rows, device), _dev(msg.positions, device)] = _dev(msg.out_cache_loc, device, torch.int32)


def unpack_batch(msg: BatchMessage, req_to_token_pool: Any, token_to_kv_pool: Any,
                 device: torch.device, group: Any = None) -> ForwardBatch:
    """The ForwardBatch of `msg` on `device` over this rank's pools (req_to_token mirrored first).

    Joins rank 0's broadcast of the resolved input ids when they follow the message; `group` is
    the tensor group (None: the default group).
    """
    mirror_req_to_token(msg, req_to_token_pool.req_to_token)
    batch = ForwardBatch(
        forward_mode=ForwardMode(msg.mode), batch_size=msg.batch_size,
        input_ids=receive_input_ids(msg, device, group), positions=_dev(msg.positions, device),
        req_pool_indices=_dev(msg.req_pool_indices, device), seq_lens=_dev(msg.seq_lens_cpu, device),
        seq_lens_cpu=msg.seq_lens_cpu, out_cache_loc=_dev(msg.out_cache_loc, device),
        req_to_token_pool=req_to_token_pool, token_to_kv_pool=token_to_kv_pool,
        return_logprob=msg.return_logprob, plugin_inputs=dict(msg.plugin_inputs),
    )
    for name, value in msg.optional.items():
        setattr(batch, name, value if name.endswith("_cpu") else _dev(value, device))
    for name in ("extend_prefix_lens", "extend_seq_lens"):
        host = msg.optional.get(name + "_cpu")
        if host is not None:
            setattr(batch, name, _dev(host, device))
    return batch


def _dev(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host tensor on `device` without a stream synchronisation (a pageable source is staged
    before the copy returns)."""
    return t.to(device, dtype, non_blocking=True)
