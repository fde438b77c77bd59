"""Timing: medians of device work (CUDA-graph replays, L2-cold calls, CUDA events), of synchronised
host-timed calls, the card's copy bandwidth (the floors' memory speed), and what a torch.profiler
run says about device kernels and the device's idle gaps."""

from __future__ import annotations

import bisect
import collections
import functools
import statistics
import time
from typing import Callable, TypeVar

import torch

L2_FLUSH_BYTES = 256 << 20  # more than any current GPU's L2 (50-60 MB on the H100 and H200)
H200_COPY_TB_S = 4.30  # device-to-device copy, bytes read + written (../shared/device/README.md)
MATMUL_PEAK_FLOP_S = 680e12  # bf16 8192^3 matmul on the H200, the lower end of the measured range
# NOTE: not measured: the bf16 figure above times Hopper's datasheet ratio of dense FP8 to bf16
# tensor-core throughput (2:1). The floors of FP8-weight prefills count their linears at this peak.
FP8_MATMUL_PEAK_FLOP_S = 2 * MATMUL_PEAK_FLOP_S
T = TypeVar("T")


def matmul_peak_flop_s(engine) -> float:
    """The peak an engine's linear layers run at: FP8's where its quantization method is an FP8 one
    (`--quantization fp8`, FP8 checkpoints), else bf16's."""
    choice = getattr(engine.runner, "quant_choice", None)
    return FP8_MATMUL_PEAK_FLOP_S if choice is not None and choice.spec.name.startswith("fp8") else MATMUL_PEAK_FLOP_S


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], T], device: torch.device | str) -> tuple[float, T]:
    """(seconds, fn()) of one call timed on the host, the device synchronised before and after it."""
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - start, result


def wall_ms(fn: Callable[[], object], device: torch.device | str, repeats: int = 30, warmup: int = 2) -> float:
    """Median milliseconds of fn() over `repeats` timed calls (timed) after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    return statistics.median(timed(fn, device)[0] for _ in range(repeats)) * 1e3


def events_ms(fn: Callable[[], object], reps: int = 50, warmup: int = 5) -> float:
    """Device milliseconds per call of `reps` back-to-back fn() calls, between two CUDA events."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def time_graph(fn: Callable[[], object], reps_in_graph: int = 20, replays: int = 50) -> float:
    """Median microseconds of one fn() call on the device: replays of a graph of reps_in_graph calls
    (launch gaps inside the graph count, operands stay in L2)."""
    replay, _ = captured(fn, reps_in_graph)
    return statistics.median(events_ms(replay, reps=1, warmup=0) * 1e3 / reps_in_graph for _ in range(replays))


def time_cold(fn: Callable[[], object], reps: int = 100) -> tuple[float, str]:
    """(median microseconds, "graph" or "eager") of one fn() call, captured, each replay after a write
    of L2_FLUSH_BYTES with CUDA events around the replay alone: operands come from HBM as in a model
    step. (An eager call, when capture fails, is timed the same way: the flush keeps the device busy
    while the host launches.)"""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    call, mode = captured(fn)
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in pairs:
        flush.zero_()
        start.record()
        call()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in pairs), mode


def captured(fn: Callable[[], object], reps: int = 1) -> tuple[Callable[[], object], str]:
    """(the replay of a CUDA graph of `reps` fn() calls, "graph"), warmed up on a side stream first so
    that lazy initialisation stays out of the graph; (`reps` eager calls, "eager") when fn cannot be captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        return graph.replay, "graph"
    except Exception:  # noqa: BLE001 - some library calls cannot be captured; time them eagerly
        torch.cuda.synchronize()
        return (lambda: [fn() for _ in range(reps)]), "eager"


def time_us(fn: Callable[[], object], device: torch.device, cold: bool = False) -> float:
    """Microseconds of one fn(): on CUDA time_cold (cold) or time_graph; elsewhere one host-timed call
    after a warm-up (CPU smoke runs exercise the code path only)."""
    if device.type == "cuda":
        return time_cold(fn, 60)[0] if cold else time_graph(fn)
    fn()
    return timed(fn, device)[0] * 1e6


@functools.cache
def copy_tb_s(device: torch.device | str = "cuda", nbytes: int = 1 << 30, reps: int = 20) -> float:
    """The device-to-device copy bandwidth in TB/s (bytes read + written), measured once per process:
    the floors' memory speed. Off CUDA, the H200's figure."""
    if torch.device(device).type != "cuda":
        return H200_COPY_TB_S
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = events_ms(functools.partial(dst.copy_, src), reps=reps, warmup=3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms / 1e3) / 1e12


def profiled(fn: Callable[[], object], device: torch.device | str, with_stack: bool = False) -> tuple[object, object]:
    """(a finished torch.profiler run of fn(), what fn returned); CPU activities, and CUDA's on a CUDA
    device; with_stack: Python function calls too (is_python_function events, the tracer's overhead in every time)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(device).type == "cuda" else [])
    with profile(activities=activities, with_stack=with_stack) as prof:
        result = fn()
        sync(device)
    return prof, result


def device_kernels(prof, per: float = 1) -> list[tuple[str, float, float]]:
    """The device kernels of a finished profiler run, slowest first: (name, ms, launches), each divided
    by `per` (e.g. the steps profiled). CUDA graph replays list their kernels one by one."""
    rows = [(e.key, (getattr(e, "self_device_time_total", 0) or 0) / 1e3 / per, e.count / per)
            for e in prof.key_averages() if str(getattr(e, "device_type", "")).endswith("CUDA")]
    return sorted(rows, key=lambda r: -r[1])


def device_gaps(prof) -> dict[str, tuple[float, int]]:
    """Idle device time in a finished profiler run by the pair of device operations around each gap:
    {"previous -> next": (ms, count)}. A gap is time when no device operation runs (on any stream):
    the device waiting for the host, or per-launch cost inside a replayed graph."""
    ops = sorted((e.time_range.start, e.time_range.end, e.key) for e in prof.events()
                 if str(getattr(e, "device_type", "")).endswith("CUDA"))
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


def profiler(device: torch.device | str):
    """An unstarted torch.profiler run with profiled's activities (CPU, and CUDA's on a CUDA device),
    for a caller that starts and stops it itself, e.g. after a prefix of a run."""
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(device).type == "cuda" else []))


def on_device(event) -> bool:
    """Whether a profiler event (or average) ran on a CUDA device."""
    return str(getattr(event, "device_type", "")).endswith("CUDA")


def without_annotations(prof):
    """A finished profiler run (events(), key_averages()) without the device-side copies of its
    record_function ranges: on CUDA every range also comes back as a device event (kineto's
    gpu_user_annotation) spanning the kernels it launched, which device_gaps and device_kernels
    would take for a device operation (hiding the idle time inside the range)."""
    from types import SimpleNamespace

    from torch.autograd.profiler_util import EventList

    def kept(events):
        return EventList([e for e in events if not (on_device(e) and getattr(e, "is_user_annotation", False))])

    events = kept(prof.events())
    return SimpleNamespace(events=lambda: events, key_averages=lambda: kept(prof.key_averages()))


# Kernel groups by name (case-insensitive substrings, first match wins; a heuristic): attention
# (FlashInfer's Batch*/MergeStates, cuDNN/PyTorch SDPA and flash kernels, the bundled Triton
# attention kernels), then GEMM (cuBLAS/cuBLASLt incl. Hopper's nvjet, CUTLASS, inductor's mm templates, the
# fp8 Triton GEMMs).
KERNEL_GROUPS = (
    ("attention", ("attention", "attn", "sdpa", "fmha", "flash_fwd", "flash::", "batchdecode", "batchprefill",
                   "mergestates", "_decode_split_kernel", "_decode_merge_kernel", "_extend_kernel", "_verify_split_kernel")),
    ("gemm", ("gemm", "nvjet", "cublas", "cutlass", "xmma", "matmul", "splitkreduce", "fused_mm", "_channel_kernel", "_block_kernel",
              "sm90_", "sm80_", "ampere_", "s16816")),
)


@functools.cache
def kernel_group(name: str) -> str:
    """"attention", "gemm" or "other" for a device operation's name (KERNEL_GROUPS; copies are "other")."""
    lowered = name.lower()
    return next((group for group, marks in KERNEL_GROUPS if any(m in lowered for m in marks)), "other")


def host_ranges(prof, name: str) -> list[tuple[float, float]]:
    """(start, end) microseconds of the host events called `name` (e.g. a record_function range), by start."""
    return sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.name == name and not on_device(e))


def merged(intervals) -> list[tuple[float, float]]:
    """The union of (start, end) intervals as disjoint intervals, by start."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def covered(windows: list[tuple[float, float]], intervals: list[tuple[float, float]]) -> list[float]:
    """For each of the disjoint (start, end) windows, by start, how much of it the disjoint intervals
    (merged) cover, in their unit."""
    out, first = [], 0
    for start, end in windows:
        while first < len(intervals) and intervals[first][1] <= start:
            first += 1
        i, total = first, 0.0
        while i < len(intervals) and intervals[i][0] < end:
            total += min(end, intervals[i][1]) - max(start, intervals[i][0])
            i += 1
        out.append(total)
    return out


def window_index(windows: list[tuple[float, float]], t: float | None) -> int | None:
    """The index of the disjoint (start, end) window, by start, that holds time t; None outside all."""
    if t is None:
        return None
    i = bisect.bisect_right(windows, (t, float("inf"))) - 1
    return i if i >= 0 and t <= windows[i][1] else None


def host_time(prof, windows: list[tuple[float, float]], names) -> list[float]:
    """For each window, the microseconds of the host events called one of `names` that start in it."""
    names, out = set(names), [0.0] * len(windows)
    for e in prof.events():
        if e.name in names and not on_device(e):
            i = window_index(windows, e.time_range.start)
            if i is not None:
                out[i] += e.time_range.elapsed_us()
    return out


def launched(prof, windows: list[tuple[float, float]]) -> tuple[list[dict[str, float]], dict[str, float]]:
    """Microseconds of device operations by kernel_group, per window that launched them: a device
    operation belongs to the window holding the start of the host event it is linked to (the op or
    record_function range innermost around its launch, through the profiler's correlation ids;
    a CUDA graph's kernels link to the range around the replay); those linked to no window: the second value."""
    events = prof.events()
    per: list[dict[str, float]] = [collections.defaultdict(float) for _ in windows]
    outside: dict[str, float] = collections.defaultdict(float)
    if events and not hasattr(events[0], "linked_correlation_id"):
        # NOTE: torch before 2.13 (the GPU machine's 2.11) links no device event to its host event in
        # events(); it lists each host event's kernels on it instead (FunctionEvent.kernels).
        for e in events:
            if not on_device(e):
                i = window_index(windows, e.time_range.start)
                for k in getattr(e, "kernels", ()):
                    (outside if i is None else per[i])[kernel_group(k.name)] += k.duration
        return [dict(d) for d in per], dict(outside)
    starts = {e.id: e.time_range.start for e in events if not on_device(e) and not e.linked_correlation_id}
    for e in events:
        if on_device(e):
            i = window_index(windows, starts.get(e.linked_correlation_id) if e.linked_correlation_id else None)
            (outside if i is None else per[i])[kernel_group(e.key)] += e.time_range.elapsed_us()
    return [dict(d) for d in per], dict(outside)
