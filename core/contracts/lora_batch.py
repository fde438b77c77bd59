"""LoraBatchInfo: how a batch's tokens map to adapter slots, kept in fixed buffers for CUDA graphs.

A batch is split into segments; a segment is a run of consecutive tokens that all use one adapter
slot. Slot 0 is, by the core's convention, the base-only slot: zero weights and rank 0.

The device buffers are allocated once for `max_segments` segments, `max_tokens` tokens and
`num_slots` slots and then rewritten in place by `update_`, so a captured CUDA graph that reads them
stays valid. Unused segments (index >= bs) always have length 0 and slot 0; `seg_indptr` stays flat
after the last one; `token_slots` is 0 after the batch's tokens. Host mirrors of the small vectors
let backends plan on the host without a device synchronisation.

Nothing goes to the device when a batch has the same segments as the one before (a decode step of
the same requests): `update_` compares the given values with the last ones on the host, before
making any tensor of them, and skips the copy (`num_device_copies` counts the copies made). The
slot vectors (ranks, scalings) are copied only when the slot pool changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

IntsLike = Sequence[int] | torch.Tensor


@dataclass
class LoraBatchInfo:
    """Segments of one batch and the per-slot rank and scaling, in fixed-size buffers.

    Device tensors (all on `device`; sizes fixed at allocation):
      seg_lens:       [max_segments] int32, tokens in each segment (0 for unused segments)
      seg_indptr:     [max_segments + 1] int32, exclusive prefix sum of seg_lens
      weight_indices: [max_segments] int32, the adapter slot of each segment
      token_slots:    [max_tokens] int32, the adapter slot of each token (0 after num_tokens)
      ranks:          [num_slots] int32, the LoRA rank of each slot (0: base only)
      scalings:       [num_slots] float32, lora_alpha / rank of each slot
    Host values (CPU, mirrors of the above, valid for the first `bs` segments):
      bs: number of segments in use; num_tokens: seg_indptr[bs]; max_len: longest segment
      seg_lens_cpu, weight_indices_cpu: [max_segments] int32
      ranks_cpu: [num_slots] int32; scalings_cpu: [num_slots] float32
    """

    bs: int
    num_tokens: int
    max_len: int
    seg_lens: torch.Tensor
    seg_indptr: torch.Tensor
    weight_indices: torch.Tensor
    ranks: torch.Tensor
    scalings: torch.Tensor
    seg_lens_cpu: torch.Tensor
    weight_indices_cpu: torch.Tensor
    ranks_cpu: torch.Tensor
    scalings_cpu: torch.Tensor
    token_slots: torch.Tensor
    _packed: torch.Tensor = field(repr=False)  # the device buffer the segment and token vectors view
    _staging: torch.Tensor = field(repr=False)  # its host twin, written then copied with one transfer
    num_device_copies: int = 0  # segment copies to the device so far (skipped when unchanged)
    _segments: tuple = field(default=((), ()), repr=False)  # the last (seg_lens, weight_indices) written

    @classmethod
    def allocate(
        cls, max_segments: int, num_slots: int, device: torch.device | str, max_tokens: int | None = None
    ) -> LoraBatchInfo:
        """Zeroed buffers for at most `max_segments` segments, `max_tokens` tokens (default: one per
        segment) and `num_slots` adapter slots."""
        max_tokens = max_segments if max_tokens is None else max_tokens
        if max_segments < 1 or num_slots < 1 or max_tokens < 1:
            raise ValueError(
                f"LoraBatchInfo.allocate: expected max_segments, num_slots and max_tokens >= 1, "
                f"got {max_segments}, {num_slots} and {max_tokens}"
            )
        n = max_segments
        packed = torch.zeros(3 * n + 1 + max_tokens, dtype=torch.int32, device=device)
        return cls(
            bs=0,
            num_tokens=0,
            max_len=0,
            seg_lens=packed[:n],
            seg_indptr=packed[n : 2 * n + 1],
            weight_indices=packed[2 * n + 1 : 3 * n + 1],
            ranks=torch.zeros(num_slots, dtype=torch.int32, device=device),
            scalings=torch.zeros(num_slots, dtype=torch.float32, device=device),
            seg_lens_cpu=torch.zeros(n, dtype=torch.int32),
            weight_indices_cpu=torch.zeros(n, dtype=torch.int32),
            ranks_cpu=torch.zeros(num_slots, dtype=torch.int32),
            scalings_cpu=torch.zeros(num_slots, dtype=torch.float32),
            token_slots=packed[3 * n + 1 :],
            _packed=packed,
            _staging=torch.zeros(3 * n + 1 + max_tokens, dtype=torch.int32),
        )

    @classmethod
    def from_segments(
        cls,
        seg_lens: IntsLike,
        weight_indices: IntsLike,
        ranks: IntsLike,
        scalings: Sequence[float] | torch.Tensor,
        device: torch.device | str,
        max_segments: int | None = None,
        max_tokens: int | None = None,
    ) -> LoraBatchInfo:
        """Allocate (exactly sized unless `max_segments` / `max_tokens` are given) and fill in one call."""
        num_segments, num_tokens = len(seg_lens), int(sum(int(v) for v in seg_lens))
        info = cls.allocate(max_segments or max(num_segments, 1), len(ranks), device, max_tokens or max(num_tokens, 1))
        return info.update_(seg_lens, weight_indices, ranks=ranks, scalings=scalings)

    @property
    def max_segments(self) -> int:
        return int(self.seg_lens.shape[0])

    @property
    def max_tokens(self) -> int:
        return int(self.token_slots.shape[0])

    @property
    def num_slots(self) -> int:
        return int(self.ranks.shape[0])

    @property
    def device(self) -> torch.device:
        return self.seg_lens.device

    def update_(
        self,
        seg_lens: IntsLike,
        weight_indices: IntsLike,
        ranks: IntsLike | None = None,
        scalings: Sequence[float] | torch.Tensor | None = None,
    ) -> LoraBatchInfo:
        """Describe a new batch in place (no reallocation); returns self.

        seg_lens, weight_indices: [bs] host ints (lists or CPU tensors), bs <= max_segments.
        ranks, scalings: [num_slots], given when the slot pool changed; otherwise kept.
        """
        segments = (_host_values(seg_lens, "seg_lens"), _host_values(weight_indices, "weight_indices"))
        if segments != self._segments:
            seg_lens_t = _host_int32(seg_lens, "seg_lens")
            slots_t = _host_int32(weight_indices, "weight_indices")
            self._check_segments(seg_lens_t, slots_t)
            self._write_segments(seg_lens_t, slots_t)
            self._segments = segments
        if ranks is not None or scalings is not None:
            self.set_slots_(ranks, scalings)
        return self

    def _write_segments(self, seg_lens_t: torch.Tensor, slots_t: torch.Tensor) -> None:
        """Stage the segments and token slots on the host, then copy them with one transfer."""
        bs, n = int(seg_lens_t.shape[0]), self.max_segments
        num_tokens = int(seg_lens_t.sum()) if bs else 0
        if num_tokens > self.max_tokens:
            raise ValueError(f"LoraBatchInfo.update_: expected at most {self.max_tokens} tokens "
                             f"(the allocated max_tokens), got {num_tokens}")
        self.seg_lens_cpu.zero_()[:bs] = seg_lens_t
        self.weight_indices_cpu.zero_()[:bs] = slots_t
        staging = self._staging
        staging[:n] = self.seg_lens_cpu
        staging[n] = 0
        torch.cumsum(self.seg_lens_cpu, 0, dtype=torch.int32, out=staging[n + 1 : 2 * n + 1])
        staging[2 * n + 1 : 3 * n + 1] = self.weight_indices_cpu
        tokens = staging[3 * n + 1 :]
        stale = max(num_tokens, self.num_tokens)  # the previous batch's token slots are zeroed too
        tokens[num_tokens:stale] = 0
        if bs:
            tokens[:num_tokens] = torch.repeat_interleave(slots_t, seg_lens_t.to(torch.int64))
        end = 3 * n + 1 + stale
        # NOTE: a pageable source is staged by the driver before copy_ returns, so reusing
        # `staging` next time is safe, and non_blocking avoids a stream synchronisation.
        self._packed[:end].copy_(staging[:end], non_blocking=True)
        self.num_device_copies += 1
        self.bs = bs
        self.num_tokens = num_tokens
        self.max_len = int(seg_lens_t.max()) if bs else 0

    def set_slots_(
        self, ranks: IntsLike | None = None, scalings: Sequence[float] | torch.Tensor | None = None
    ) -> LoraBatchInfo:
        """Rewrite, in place, the rank and/or scaling of every slot ([num_slots] each); returns self."""
        if ranks is not None:
            ranks_t = _host_int32(ranks, "ranks")
            self._check_slot_vector(ranks_t, "ranks")
            if bool((ranks_t < 0).any()):
                raise ValueError(f"LoraBatchInfo: expected ranks >= 0, got {ranks_t.tolist()}")
            self.ranks_cpu.copy_(ranks_t)
            self.ranks.copy_(ranks_t, non_blocking=True)
        if scalings is not None:
            scalings_t = torch.as_tensor(scalings, dtype=torch.float32, device="cpu").reshape(-1)
            self._check_slot_vector(scalings_t, "scalings")
            self.scalings_cpu.copy_(scalings_t)
            self.scalings.copy_(scalings_t, non_blocking=True)
        return self

    def _check_segments(self, seg_lens: torch.Tensor, slots: torch.Tensor) -> None:
        bs = int(seg_lens.shape[0])
        if bs > self.max_segments:
            raise ValueError(
                f"LoraBatchInfo.update_: expected at most {self.max_segments} segments "
                f"(the allocated max_segments), got {bs}"
            )
        if int(slots.shape[0]) != bs:
            raise ValueError(
                f"LoraBatchInfo.update_: expected one weight index per segment ({bs}), got {slots.shape[0]}"
            )
        if bs and bool((seg_lens < 0).any()):
            raise ValueError(f"LoraBatchInfo.update_: expected seg_lens >= 0, got {seg_lens.tolist()}")
        if bs and bool(((slots < 0) | (slots >= self.num_slots)).any()):
            raise ValueError(
                f"LoraBatchInfo.update_: expected weight indices in [0, {self.num_slots}), "
                f"got {slots.tolist()}"
            )

    def _check_slot_vector(self, values: torch.Tensor, what: str) -> None:
        if int(values.shape[0]) != self.num_slots:
            raise ValueError(
                f"LoraBatchInfo: expected {what} for {self.num_slots} slots, got {values.shape[0]} values"
            )


def _host_values(values: IntsLike, what: str) -> tuple:
    """The values as a tuple (a cheap comparison key); a CUDA tensor is refused (it would synchronise)."""
    if isinstance(values, torch.Tensor):
        return tuple(_host_int32(values, what).tolist())
    return tuple(values)


def _host_int32(values: IntsLike, what: str) -> torch.Tensor:
    """A 1-D int32 CPU tensor from a list or tensor; a CUDA tensor is refused (it would synchronise)."""
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise ValueError(
                f"LoraBatchInfo: expected {what} on the host (list or CPU tensor), got {values.device}"
            )
        return values.reshape(-1).to(torch.int32)
    return torch.tensor(list(values), dtype=torch.int32)


@dataclass(frozen=True)
class LoraSegments:
    """What the LoRA participant describes of a batch (`ForwardBatch.plugin_inputs["lora"]`):
    host data only, so tensor parallelism ships it as it is.

    seg_lens, slots: [num_segments] one segment per request, its new tokens and its adapter slot
    (0: base only); slot_of: adapter name -> slot of every adapter resident when the batch was
    described, which a tensor-parallel rank mirrors before its forward.
    """

    seg_lens: tuple[int, ...]
    slots: tuple[int, ...]
    slot_of: tuple[tuple[str, int], ...] = ()
