"""Piecewise CUDA graphs: the forward recorded as graph segments split at every attention call.

For an attention backend that declares a mode in `piecewise_graph_modes` (its planning cannot live
in static buffers), the graph runner records everything between two attention calls (norms,
projections, rotary, the K/V write when fused, MLP, LoRA, logits) as one CUDA graph segment, and
at replay runs the segments in order with the backend's attention eagerly between them:

    segment 0 | attention(layer 0) | segment 1 | attention(layer 1) | ... | segment L

The attention calls at replay get the tensors the segments wrote (static: recorded in the graph
pool) and the replay's padded batch, after `init_forward_metadata(batch)`; each call's output is
copied into the tensor the next segment reads. A model of L layers costs L + 1 graph launches and
L eager attention calls instead of its whole launch sequence. This is SGLang's "breakable" graph,
done without torch.compile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from backplane.contracts.attention import AttentionLayerInfo
from backplane.contracts.batch import ForwardBatch


@dataclass
class AttentionCall:
    """One attention call between two segments: its (static) inputs and the output the next segment reads."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    layer: AttentionLayerInfo
    kv_written: bool
    out: torch.Tensor


class PiecewiseGraph:
    """The segments and attention calls of one captured forward; `replay(batch)` runs them in order."""

    def __init__(self, backend: Any):
        self.backend = backend
        self.segments: list[torch.cuda.CUDAGraph] = []
        self.calls: list[AttentionCall] = []

    def replay(self, batch: ForwardBatch) -> None:
        """Replay for `batch`, the padded view of the static buffers (planned: init_forward_metadata)."""
        for i, segment in enumerate(self.segments):
            segment.replay()
            if i < len(self.calls):
                call = self.calls[i]
                call.out.copy_(_attend(self.backend, call.q, call.k, call.v, call.layer, batch, call.kv_written))


def _attend(backend: Any, q, k, v, layer: AttentionLayerInfo, batch: ForwardBatch, kv_written: bool) -> torch.Tensor:
    if kv_written:  # only for backends that opted in (fuses_rotary_kv_write)
        return backend.forward(q, k, v, layer, batch, kv_written=True)
    return backend.forward(q, k, v, layer, batch)


class _Recorder:
    """Opens and closes segment captures around the eager attention calls."""

    def __init__(self, graph: PiecewiseGraph, pool: Any):
        self.graph, self.pool = graph, pool
        self.current: torch.cuda.CUDAGraph | None = None

    def open(self) -> None:
        self.current = torch.cuda.CUDAGraph()
        self.current.capture_begin(pool=self.pool)

    def close(self) -> None:
        self.current.capture_end()
        self.graph.segments.append(self.current)
        self.current = None


class SegmentingBackend:
    """The attention backend a piecewise capture binds in its ForwardContext: every call closes the
    running segment, runs the real backend eagerly, records the call and opens the next segment."""

    def __init__(self, inner: Any, recorder: _Recorder):
        self.inner, self.recorder = inner, recorder

    def fuses_rotary_kv_write(self, batch: ForwardBatch) -> bool:
        return self.inner.fuses_rotary_kv_write(batch)

    def forward(self, q, k, v, layer: AttentionLayerInfo, batch: ForwardBatch, kv_written: bool = False):
        self.recorder.close()
        out = _attend(self.inner, q, k, v, layer, batch, kv_written)
        self.recorder.graph.calls.append(AttentionCall(q, k, v, layer, kv_written, out))
        self.recorder.open()
        return out

    def __getattr__(self, name: str) -> Any:  # anything else a layer may ask of its backend
        return getattr(self.inner, name)


def release_allocator_caches() -> None:
    """What `torch.cuda.graph` does before it begins a capture: wait for the device, then return the
    unused cache of the device allocator and of the pinned host allocator. The host allocator keeps
    a graph pool whose graphs have all been freed (an earlier runner's) with a reference count of
    zero until its cache is emptied, and a capture into that pool id before then fails its internal
    assert (`use_count > 0`, CachingHostAllocator.h): a capture that calls `capture_begin` itself
    must empty it first."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    host_empty_cache = getattr(torch._C, "_host_emptyCache", None)  # CUDA builds of torch
    if host_empty_cache is not None:
        host_empty_cache()


def capture_piecewise(run: Callable[[Any], Any], backend: Any, pool: Any, warmup: int = 2) -> tuple[PiecewiseGraph, Any]:
    """Warm up `run(backend)` eagerly, then capture `run(segmenting backend)` in segments into
    memory pool `pool`. `run(attn_backend)` runs the forward with that backend bound in its
    ForwardContext (the caller planned the backend's metadata for the batch). Returns the
    PiecewiseGraph and the captured call's output (static: every replay overwrites it)."""
    for _ in range(warmup):
        run(backend)
    release_allocator_caches()
    graph = PiecewiseGraph(backend)
    recorder = _Recorder(graph, pool)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        recorder.open()
        try:
            output = run(SegmentingBackend(backend, recorder))
        finally:
            if recorder.current is not None:
                recorder.close()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return graph, output
