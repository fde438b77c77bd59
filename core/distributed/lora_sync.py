"""Keeping a worker's LoRA slots and batch segments equal to rank 0's.

Rank 0's LoraManager decides which adapter sits in which slot (it sees the running requests);
each batch carries that slot table and the batch's segments, and the worker loads into its own
(sharded) slot buffers whatever differs before building the same LoraBatchInfo.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from backplane.lora.manager import LoraManager


@dataclass
class LoraMessage:
    """seg_lens, slots: [num_segments] host ints; slot_of: adapter name -> slot, as on rank 0."""

    seg_lens: list[int]
    slots: list[int]
    slot_of: dict[str, int]


@runtime_checkable
class LoraSlotTable(Protocol):
    """What rank 0's driver reads of its LoraManager: which adapter sits in which slot."""

    def resident_slots(self) -> dict[str, int]:
        """Adapter name -> slot, for every adapter now loaded."""


def pack_lora(slots: LoraSlotTable | None, batch: Any) -> LoraMessage | None:
    """rank 0: the batch's LoRA segments and the resident adapters (None for a base-only batch)."""
    info = getattr(batch, "lora_info", None)
    if slots is None or info is None:
        return None
    bs = info.bs
    return LoraMessage(info.seg_lens_cpu[:bs].tolist(), info.weight_indices_cpu[:bs].tolist(),
                       slots.resident_slots())


class LoraMirror:
    """A worker's view of rank 0's slot table, over the worker's own LoraManager."""

    def __init__(self, manager: LoraManager | None):
        self.manager = manager
        self.resident: dict[int, str] = {}  # slot -> adapter name loaded there

    def apply(self, msg: LoraMessage | None, batch: Any) -> None:
        """Load the adapters rank 0 has resident but this rank does not, then set batch.lora_info."""
        if msg is None:
            batch.lora_info = None
            return
        if self.manager is None:
            raise RuntimeError("tensor-parallel worker: rank 0 sent a LoRA batch, but this rank has no LoRA manager")
        for name, slot in msg.slot_of.items():
            if self.resident.get(slot) != name:
                self.manager.mirror_slot(name, slot)  # the manager's own loader: this rank's shards
                self.resident[slot] = name
        batch.lora_info = self.manager.batch_info_for(msg.seg_lens, msg.slots)
