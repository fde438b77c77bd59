"""What every model receives when built (ModelContext); what it returns, ModelOutput, is a contract
(backplane.contracts.model) re-exported here."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from backplane.contracts.forward_context import ForwardContext, ForwardSlot
from backplane.contracts.model import ModelOutput  # noqa: F401  (re-exported)
from backplane.layers.parallel import ParallelContext
from backplane.ops.dispatch import CustomOps


class ModelContext:
    """Shared by every layer of one model: what it is built with, and where its layers find the
    forward now running.

    attn_backend: the model's attention backend (an AttentionBackend or a composite), set once by
      the model runner after the model is built (the backend needs the KV pool, sized from the
      model). ops: the resolved custom-op table. Both are defaults: during a forward the layers
      read `attn_backend` and `ops` of the bound ForwardContext (`forward_slot`), which the runner
      enters once per forward (graph capture once per graph); between forwards nothing is bound.
    dtype, device: where the parameters live. parallel: this rank's tensor-parallel position.
    moe_backend: the model's MoeBackend (backplane.contracts.moe), shared by its MoE layers; the
      model runner sets it before the model is built (--moe-backend). When nothing set it (a model
      built directly, in a test), the core's torch_native reference, built on first use.
    """

    def __init__(self, attn_backend: Any = None, ops: CustomOps | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", parallel: ParallelContext | None = None):
        self.default_attn_backend = attn_backend
        self.default_ops = ops if ops is not None else CustomOps.native()
        self.dtype = dtype
        self.device = device
        self.parallel = parallel if parallel is not None else ParallelContext()
        self.forward_slot = ForwardSlot("model")
        self._moe_backend: Any = None

    def __repr__(self) -> str:
        return (f"ModelContext(dtype={self.dtype}, device={self.device}, parallel={self.parallel}, "
                f"forward={'bound' if self.forward_slot.active else 'none'})")

    @property
    def forward(self) -> ForwardContext | None:
        """The ForwardContext of the forward now running, or None between forwards."""
        return self.forward_slot.active

    @property
    def attn_backend(self) -> Any:
        """The running forward's attention backend, else the model's default."""
        bound = self.forward_slot.active
        return bound.attn_backend if bound is not None else self.default_attn_backend

    @attn_backend.setter
    def attn_backend(self, backend: Any) -> None:
        self.default_attn_backend = backend

    @property
    def moe_backend(self) -> Any:
        """The model's MoeBackend; torch_native when none was set (built once, on first use)."""
        if self._moe_backend is None:
            from backplane.moe.builtin import torch_native_backend

            self._moe_backend = torch_native_backend()
        return self._moe_backend

    @moe_backend.setter
    def moe_backend(self, backend: Any) -> None:
        self._moe_backend = backend

    @property
    def ops(self) -> CustomOps:
        """The running forward's op table (the compile-safe one inside torch.compile), else the default."""
        bound = self.forward_slot.active
        return bound.ops if bound is not None else self.default_ops

    @ops.setter
    def ops(self, table: CustomOps) -> None:
        self.default_ops = table

    def context_for(self, batch: Any, attn_backend: Any = None, ops: CustomOps | None = None,
                    **fields: Any) -> ForwardContext:
        """A ForwardContext over `batch`; the backend and op table default to the model's."""
        return ForwardContext(batch=batch, attn_backend=attn_backend or self.default_attn_backend,
                              ops=ops or self.default_ops, **fields)

    def bind(self, context: ForwardContext):
        """`with model_ctx.bind(context): model(batch)`: one forward under `context` (no nesting)."""
        return self.forward_slot.enter(context)

    @contextmanager
    def use_attention(self, backend: Any) -> Iterator[Any]:
        """Deprecated since 0.2: bind a ForwardContext instead (`bind(context_for(batch, backend))`).

        Runs the block as one forward under `backend`; refuses to nest inside a bound forward."""
        warnings.warn("ModelContext.use_attention is deprecated since backplane 0.2; enter a ForwardContext "
                      "with model_ctx.bind(model_ctx.context_for(batch, attn_backend=backend))",
                      DeprecationWarning, stacklevel=3)
        with self.bind(self.context_for(None, attn_backend=backend)):
            yield backend
