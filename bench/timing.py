"""GPU timing shared by the kernel benchmarks: a function's median time from CUDA-graph replays."""

from __future__ import annotations

import functools
import statistics
from typing import Callable

import torch


L2_FLUSH_BYTES = 256 << 20  # more than any current GPU's L2 (50-60 MB on the H100 and H200)


def time_graph(fn: Callable[[], object], reps_in_graph: int = 20, replays: int = 50, cold: bool = False) -> float:
    """Median microseconds of one fn() call, from replays of a graph holding reps_in_graph calls
    (warmed up on a side stream first, so lazy initialisation stays out of the graph).

    cold: instead, eager calls each after a write of L2_FLUSH_BYTES, timed by CUDA events around the
    call alone (as triton.testing.do_bench does), so fn's operands come from HBM as inside a model
    step; back-to-back calls would find them in L2, which flatters latency-bound kernels. The flush
    keeps the device busy while the host enqueues fn, so the events see the kernels, not the launch.
    """
    if cold:
        return _cold_median_us(fn, reps_in_graph * 3)
    return _graph_median_us(fn, reps_in_graph, replays)


def _cold_median_us(fn: Callable[[], object], reps: int) -> float:
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        fn()
    pairs = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) * 1000 for start, end in pairs)


def _graph_median_us(fn: Callable[[], object], reps_in_graph: int, replays: int) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps_in_graph):
            fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / reps_in_graph)
    return statistics.median(times)


H200_COPY_TB_S = 4.30  # device-to-device copy, bytes read + written (../shared/device/README.md)


def copy_bandwidth_tb_s(device: torch.device | str = "cuda", nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Measured device-to-device copy bandwidth in TB/s (bytes read + written), the floors' memory
    speed on whatever card runs the benchmark; the H200's figure off CUDA (CPU smoke runs)."""
    if torch.device(device).type != "cuda":
        return H200_COPY_TB_S
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    end.synchronize()
    tb_s = 2 * nbytes * reps / (start.elapsed_time(end) / 1e3) / 1e12
    del src, dst
    torch.cuda.empty_cache()
    return tb_s


@functools.cache
def peak_bytes_per_s(device: str | None = None) -> float:
    """The floors' memory speed in bytes/s: the card's measured copy bandwidth, once per process
    (device None: CUDA when there is one; off CUDA the H200's figure)."""
    return copy_bandwidth_tb_s(device or ("cuda" if torch.cuda.is_available() else "cpu")) * 1e12


def device_gaps(prof) -> dict[str, tuple[float, int]]:
    """Idle device time in a finished torch.profiler run, by the pair of device operations around
    each gap: {"previous -> next": (ms, count)}. A gap is time when no device operation runs (on any
    stream) between one operation's end and the next one's start: the device waiting for the host,
    or per-launch cost inside a replayed graph."""
    ops = sorted(((e.time_range.start, e.time_range.end, e.key) for e in prof.events()
                  if str(getattr(e, "device_type", "")).endswith("CUDA")), key=lambda o: o[0])
    gaps: dict[str, tuple[float, int]] = {}
    busy_until, previous = None, None
    for start, end, name in ops:
        if busy_until is not None and start > busy_until:
            key = f"{previous[:32]} -> {name[:32]}"
            ms, n = gaps.get(key, (0.0, 0))
            gaps[key] = (ms + (start - busy_until) / 1e3, n + 1)
        if busy_until is None or end >= busy_until:
            busy_until, previous = end, name
    return gaps


def device_kernels(prof, per: int = 1) -> list[tuple[str, float, float]]:
    """The device kernels of a finished torch.profiler run, slowest first: (name, ms, launches), each
    divided by `per` (e.g. the steps profiled). CUDA graph replays list their kernels one by one."""
    rows = [(e.key, (getattr(e, "self_device_time_total", 0) or 0) / 1e3 / per, e.count / per)
            for e in prof.key_averages() if str(getattr(e, "device_type", "")).endswith("CUDA")]
    return sorted(rows, key=lambda r: -r[1])
