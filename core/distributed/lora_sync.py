"""Deprecated shims of the LoRA-specific tensor-parallel packing (backplane 0.1).

Since 0.2 a batch's LoRA description is host data in `ForwardBatch.plugin_inputs["lora"]` (a
LoraSegments with the slot table), shipped to the workers with the rest of the batch
(backplane.distributed.batch_sync); each worker's LoraManager mirrors rank 0's slots from it in
`begin_forward`. `pack_lora` now returns None and `LoraMirror.apply` only checks that a worker that
receives a LoRA batch has a manager.
"""

from __future__ import annotations

from typing import Any


def pack_lora(slots: Any, batch: Any) -> None:
    """Nothing to pack: LoRA rides in `batch.plugin_inputs` (see the module docstring)."""
    return None


class LoraMirror:
    """A worker's check that it can serve LoRA batches; the mirroring itself is the manager's."""

    def __init__(self, manager: Any):
        self.manager = manager

    def apply(self, msg: Any, batch: Any) -> None:
        if self.manager is None and batch.plugin_inputs.get("lora") is not None:
            raise RuntimeError("tensor-parallel worker: rank 0 sent a LoRA batch, but this rank has no LoRA manager")


class LoraSlotTable:  # NOTE: kept for the driver's annotation until it drops it
    """Deprecated: rank 0's slot table now travels in each LoRA batch's plugin_inputs."""
