"""What is left of the LoRA-specific tensor-parallel packing of backplane 0.1.

Since 0.2 a batch's LoRA description is host data in `ForwardBatch.plugin_inputs["lora"]` (a
LoraSegments with the slot table), shipped to the workers with the rest of the batch
(backplane.distributed.batch_sync); each worker's LoraManager mirrors rank 0's slots from it in
`begin_forward`; `LoraMirror.apply` only checks that a worker that receives a LoRA batch has a
manager.
"""

from __future__ import annotations

from typing import Any


class LoraMirror:
    """A worker's check that it can serve LoRA batches; the mirroring itself is the manager's."""

    def __init__(self, manager: Any):
        self.manager = manager

    def apply(self, msg: Any, batch: Any) -> None:
        """A LoRA batch on a rank without a manager is an error (it would run without its adapters)."""
        if self.manager is None and batch.plugin_inputs.get("lora") is not None:
            raise RuntimeError("tensor-parallel worker: rank 0 sent a LoRA batch, but this rank has no LoRA manager")

