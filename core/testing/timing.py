"""Kernel timing for a plugin's tuner: a CUDA-graph replay with L2 flushed before each one."""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def l2_flush_buffer(mib: int = 256) -> torch.Tensor:
    """A buffer larger than the card's L2 (50 MiB on an H100): zeroing it evicts what a kernel read."""
    return torch.empty(mib * 2**20, dtype=torch.uint8, device="cuda")


def cold_graph_us(fn: Callable[[], object], flush: torch.Tensor, reps: int = 25) -> float:
    """Median microseconds of `fn()` captured once in a CUDA graph and replayed `reps` times, `flush`
    zeroed before each replay (so weights come from HBM, as in a model's forward). One warm-up run
    on a side stream first (Triton compiles there, outside the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)
