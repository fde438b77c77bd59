"""DraftAttention: which attention backend each forward of the draft head runs under.

The draft extend has its backend and every beam step its own (a captured multi-step graph needs
each step's own static buffers). A pass binds a ForwardContext with its backend on the head's
ModelContext for that one forward, so nothing of a pass stays bound afterwards, also when the
forward raises.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from backplane import ForwardBatch
from backplane.attention import AttentionBackend
from backplane.models import ModelContext


@dataclass
class DraftAttention:
    """model_ctx: the draft head's context; extend: the draft extend's backend; steps: one backend
    per beam step. plan: an eager pass plans each batch's metadata when it binds the backend; a
    graph pass does not (the metadata was bound at capture and is refreshed before each replay)."""

    model_ctx: ModelContext
    extend: AttentionBackend
    steps: list[AttentionBackend]
    plan: bool = True

    def extend_pass(self, batch: ForwardBatch):
        """`with attention.extend_pass(batch): head(...)`: the draft extend over `batch`."""
        return self._bind(self.extend, batch)

    def step_pass(self, i: int, batch: ForwardBatch):
        """`with attention.step_pass(i, batch): head(...)`: beam step i (0: the first after the root)."""
        return self._bind(self.steps[i], batch)

    @contextmanager
    def _bind(self, backend: AttentionBackend, batch: ForwardBatch) -> Iterator[None]:
        with self.model_ctx.bind(self.model_ctx.context_for(batch, attn_backend=backend)):
            if self.plan:
                backend.init_forward_metadata(batch)
            yield
