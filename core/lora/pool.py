"""SlotPool: which adapter sits in which device slot, with least-recently-used eviction.

Pure bookkeeping (no tensors), so the policy is tested on its own. Slot 0 is the base-only slot
and is never handed out; adapters use slots 1..num_adapter_slots.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class SlotPool:
    """Adapter name -> slot, most recently used last."""

    def __init__(self, num_adapter_slots: int) -> None:
        if num_adapter_slots < 1:
            raise ValueError(f"SlotPool: expected at least one adapter slot, got {num_adapter_slots}")
        self.num_adapter_slots = num_adapter_slots
        self.slot_of: OrderedDict[str, int] = OrderedDict()
        self.free_slots = list(range(num_adapter_slots, 0, -1))  # popped from the end: 1 first
        self.num_loads = 0
        self.num_evictions = 0

    def assign(self, needed: Iterable[str], pinned: Iterable[str] = ()) -> list[tuple[str, int]]:
        """Make every adapter of `needed` resident; return the (name, slot) pairs to load now.

        A new adapter takes a free slot, else the slot of the least recently used resident adapter
        that is neither needed nor `pinned` (used by a running request); only when every resident
        adapter is pinned does a pinned one that this batch does not need go (it is reloaded when
        its request runs again). Raises when `needed` has more adapters than there are slots.
        """
        needed = list(dict.fromkeys(needed))
        if len(needed) > self.num_adapter_slots:
            raise RuntimeError(
                f"SlotPool: a batch needs {len(needed)} adapters but there are {self.num_adapter_slots} slots; "
                "the scheduler must not put more distinct adapters in one batch (--max-loras-per-batch)"
            )
        for name in needed:
            if name in self.slot_of:
                self.slot_of.move_to_end(name)
        loads = []
        protected = set(needed) | set(pinned)
        for name in needed:
            if name not in self.slot_of:
                slot = self._take_slot(protected, set(needed))
                self.slot_of[name] = slot
                self.num_loads += 1
                loads.append((name, slot))
        return loads

    def _take_slot(self, protected: set[str], needed: set[str]) -> int:
        if self.free_slots:
            return self.free_slots.pop()
        for keep in (protected, needed):
            victim = next((n for n in self.slot_of if n not in keep), None)
            if victim is not None:
                self.num_evictions += 1
                return self.slot_of.pop(victim)
        raise AssertionError("SlotPool: no slot to evict although len(needed) <= slots")

    def slots_for(self, names: Iterable[str | None]) -> list[int]:
        """The slot of each name (0 for None: base only); every name must be resident."""
        return [0 if name is None else self.slot_of[name] for name in names]
