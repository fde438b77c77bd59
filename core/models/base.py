"""What every model receives when built (ModelContext); what it returns, ModelOutput, is a contract
(backplane.contracts.model) re-exported here."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from backplane.contracts.model import ModelOutput  # noqa: F401  (re-exported)
from backplane.layers.parallel import ParallelContext
from backplane.ops.dispatch import CustomOps


@dataclass
class ModelContext:
    """Shared by every layer of one model.

    attn_backend: an object with `.forward(q, k, v, layer_info, batch)` (an AttentionBackend or a
      composite of several). The layers read it, and `ops`, at every call, so the model runner
      sets the model's backend once after the model is built (the backend needs the KV pool, sized
      from the model) and may swap `ops` for `ops.for_compile()` inside torch.compile. A forward
      that runs under another backend (a draft model's passes, each with its own) binds it with
      `use_attention(backend)` for that forward only.
    dtype, device: where the parameters live. parallel: this rank's tensor-parallel position.
    """

    attn_backend: Any = None
    ops: CustomOps = field(default_factory=CustomOps.native)
    dtype: torch.dtype = torch.float32
    device: torch.device | str = "cpu"
    parallel: ParallelContext = field(default_factory=ParallelContext)

    @contextmanager
    def use_attention(self, backend: Any) -> Iterator[Any]:
        """Make `backend` the layers' attention backend inside the block; the one before is back on
        exit, also when the block raises. Yields `backend`. Blocks nest.

            with model_ctx.use_attention(draft_backend):
                draft_backend.init_forward_metadata(batch)
                hidden = head(..., batch)
        """
        previous, self.attn_backend = self.attn_backend, backend
        try:
            yield backend
        finally:
            self.attn_backend = previous
