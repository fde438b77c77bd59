"""The collaborators of the model runner and the scheduler, as small declared Protocols.

Components meet through these, handed over in a constructor or in one registration call made
while the engine is built; none is assigned onto another component afterwards:

- `GraphContributor` (the LoraManager): per-forward state the model's layers read. It returns its
  binding for each forward, which the runner puts in that forward's ForwardContext
  (`ModelRunner.add_contributor`, before `init_cuda_graphs`); since it changes the recorded
  kernels, it takes part in CUDA graph capture and in every graph key.
- `SchedulerParticipant` (the LoraManager): the scheduler asks it whether a request may join the
  running ones and lets it describe each batch's inputs in `batch.plugin_inputs` (host data)
  (`Scheduler(participants=...)`); speculative verify batches go through the same participants
  (`SpecContext.participants`).
- `RunningRequests` (the Scheduler): who knows the requests now running
  (`LoraManager.bind_running`: their adapters are not evicted).
- `ForwardRouter` (the tensor-parallel driver): where rank 0's forwards go
  (`ModelRunner(router=...)`): it sends the batch to the other ranks, then runs the local forward.

They are `runtime_checkable`, so a registration can refuse an object that lacks a method.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from backplane.contracts.batch import ForwardBatch
    from backplane.contracts.graph import GraphKey, GraphParticipant
    from backplane.contracts.model import ModelOutput

GraphExtras = tuple[tuple[str, Hashable], ...]  # one contributor's items of a GraphKey's extras


@runtime_checkable
class GraphContributor(Protocol):
    """Per-batch state that the model's layers read and that changes the recorded kernels."""

    def begin_forward(self, batch: ForwardBatch) -> Mapping[str, Any]:
        """Called by the runner right before an eager forward of `batch`: plan it and return the
        contributor's bindings ({name: value}), which the runner binds in the forward's
        ForwardContext (the layers read them there). Graph batches use `prepare_graph_batch`."""

    def graph_participant(self) -> GraphParticipant:
        """Which modes the contributor can run inside a CUDA graph (the runner captures the
        minimum over every participant), and which plugin to name when it limits them."""

    def graph_variants(self) -> list[GraphExtras]:
        """Every value its graph-key items can take; one graph is captured per combination."""

    def graph_key_extras(self, batch: ForwardBatch) -> GraphExtras:
        """Its items of the key of the graph that can replay `batch`, e.g. (("lora", True),)."""

    def prepare_graph_batch(self, batch: ForwardBatch, key: GraphKey,
                            real: ForwardBatch | None = None) -> Mapping[str, Any]:
        """Its state for a graph batch, written into the captured static buffers: for capture (`real`
        None, `batch` all padding; the returned bindings go into the capture's ForwardContext) or
        for replay (`batch` is `real` padded to `key`; a replay runs no Python, the return is unused)."""


@runtime_checkable
class SchedulerParticipant(Protocol):
    """Takes part in scheduling; `req` is an engine request (`backplane.scheduler.request.Req`)."""

    def can_admit(self, req: Any, batch_mates: Sequence[Any]) -> bool:
        """Whether `req` may run next to `batch_mates` (the running requests and those admitted
        in the same step); False keeps it waiting."""

    def prepare_batch(self, batch: ForwardBatch, reqs: Sequence[Any]) -> None:
        """Describe `batch`, built from `reqs` in order, before it runs, in `batch.plugin_inputs[name]`
        (host data; LoRA: "lora" -> LoraSegments)."""


@runtime_checkable
class RunningRequests(Protocol):
    """The requests that now hold a request row (the Scheduler's running set), read live."""

    running: Sequence[Any]


@runtime_checkable
class ForwardRouter(Protocol):
    """Where rank 0's forwards go under tensor parallelism (the TPDriver)."""

    def run(self, batch: ForwardBatch, forward_local: Callable[[ForwardBatch], ModelOutput], *,
            use_graph: bool = True) -> ModelOutput:
        """Send `batch` to every other rank, then return `forward_local(batch)`, this rank's output;
        use_graph False: every rank runs the forward eagerly."""
