"""ForwardContext: everything one forward pass binds besides its inputs, entered in one place.

A ForwardBatch is what the model computes on (token ids, positions, lengths, pools). What the
forward runs *with* is a ForwardContext: the attention backend, the custom-op table, each
contributor's per-forward binding (LoRA: the batch's segment info), whether the model returns
hidden states, and the buffer the logits go to. The model runner builds one per forward (graph
capture builds one per captured graph) and enters it on the model's `ForwardSlot`; the layers and
the opaque ops read it from there. On exit the slot is empty again, also when the forward raised,
so nothing of one forward is left bound for the next.

    with model_ctx.forward_slot.enter(ForwardContext(batch=batch, attn_backend=backend, ops=ops)):
        output = model(batch)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from backplane.contracts.batch import ForwardBatch
    from backplane.contracts.graph import GraphKey


@dataclass(frozen=True)
class ForwardContext:
    """One forward's bindings; frozen: a forward never rebinds its context midway.

    batch: the forward's inputs (None for a pass that binds only a backend, as a draft head's).
    attn_backend: the AttentionBackend (or composite) the attention layers call.
    ops: the custom-op table the layers call (`CustomOps`; its compile-safe subset inside torch.compile).
    bindings: each graph contributor's state for this forward, by name (LoRA: "lora" ->
      LoraBatchInfo, absent or None for a base-only forward); read-only.
    capture_hidden: the model returns the final-normed hidden states too (EAGLE drafts from them).
    logits_out: a caller-owned fp32 [rows >= selected tokens, vocab] buffer the logits layer
      writes into (graph capture), or None for a fresh tensor.
    graph_key: the graph being captured, None for an eager or compiled forward.
    """

    batch: ForwardBatch | None
    attn_backend: Any
    ops: Any
    bindings: Mapping[str, Any] = field(default_factory=dict)
    capture_hidden: bool = False
    logits_out: torch.Tensor | None = None
    graph_key: GraphKey | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "bindings", MappingProxyType(dict(self.bindings)))

    def binding(self, name: str) -> Any:
        """The contributor `name`'s binding for this forward, or None."""
        return self.bindings.get(name)


class NestedForwardError(RuntimeError):
    """A forward context was entered while another one is bound on the same model."""


class ForwardSlot:
    """Where one model's layers find the ForwardContext of the forward now running.

    One slot per model (its ModelContext holds it). `enter` refuses nesting: a forward inside a
    forward of the same model is a bug (two batches would share one set of layers' bindings).
    """

    __slots__ = ("_current", "owner")

    def __init__(self, owner: str = "model") -> None:
        self._current: ForwardContext | None = None
        self.owner = owner

    @property
    def active(self) -> ForwardContext | None:
        """The bound context, or None between forwards."""
        return self._current

    @property
    def current(self) -> ForwardContext:
        """The bound context; a RuntimeError outside a forward."""
        if self._current is None:
            raise RuntimeError(f"{self.owner}: no forward is running (a layer or opaque op was called outside "
                               "ModelRunner.forward / ForwardSlot.enter)")
        return self._current

    @contextmanager
    def enter(self, context: ForwardContext) -> Iterator[ForwardContext]:
        """Bind `context` for the block; unbound on exit, also when the block raises."""
        if self._current is not None:
            raise NestedForwardError(f"{self.owner}: a forward context is already bound; forwards of one model "
                                     "do not nest (finish the running forward first)")
        self._current = context
        try:
            yield context
        finally:
            self._current = None
