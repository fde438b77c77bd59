"""Engines as the benchmarks build, time and release them, and what one decode step costs measured
from the outside: the whole `generate` loop per step, the captured decode graph's replay alone, and a
profiler's split of a step into device kernels and the device's idle gaps; and a profiler's split of
one request (its host ops and Python functions, synchronisations, copies, kernels, device busy and
idle time). (`backplane bench` times a one-batch step eager and through graphs.)"""

from __future__ import annotations

import collections
import gc
import time
from typing import Callable, TypeVar

import torch

from backplane import Engine, SamplingParams
from bench import workload
from bench.timing import device_gaps, device_kernels, events_ms, profiled, timed, without_annotations

T = TypeVar("T")
REQUEST = "bench.request"  # the profiler range of profile_request's request
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def with_engines(settings: dict[str, dict], fn: Callable[[dict[str, Engine]], T],
                 startup_s: dict[str, float] | None = None) -> T:
    """fn({name: Engine(**settings[name])}), the engines built side by side ("model" among the settings),
    in order, the seconds each took to build written to `startup_s`; then, an error included, every
    engine shut down and its memory given back, so that the next engine or the peer finds the device
    empty. fn's return value must not hold an engine."""
    engines: dict[str, Engine] = {}
    try:
        for name, kwargs in settings.items():
            start = time.perf_counter()
            engines[name] = Engine(**kwargs)
            if startup_s is not None:
                startup_s[name] = time.perf_counter() - start
        return fn(engines)
    finally:
        while engines:  # NOTE: popped, no name left bound: fn has returned, so the collection frees them
            engines.popitem()[1].shutdown()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def with_engine(settings: dict, fn: Callable[[Engine], T]) -> T:
    """with_engines for one engine: fn(Engine(**settings))."""
    return with_engines({"engine": settings}, lambda engines: fn(engines["engine"]))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def timed_generate(engine: Engine, prompts, params, lora=None) -> tuple[float, list]:
    """(seconds, outputs) of one generate call, the device synchronised around it; a RuntimeError
    naming the first error when a request failed."""
    seconds, outs = timed(lambda: engine.generate(input_ids=prompts, sampling_params=params, lora=lora),
                          engine.runner.device)
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(outs)} requests failed, first: {errors[0]}")
    return seconds, outs


def _generate(engine: Engine, prompts, n: int, lora=None) -> float:
    return timed_generate(engine, prompts, greedy(n), lora)[0]


def interleaved(engines: dict, batch_sizes: list[int], rounds: int, step: Callable[[str, int], float]) -> dict:
    """{(name, bs): [step(name, bs) of each round]} over every engine and batch size, in `rounds`
    interleaved rounds, so that host noise hits every engine alike."""
    samples = {(name, bs): [] for name in engines for bs in batch_sizes}
    for _ in range(rounds):
        for bs in batch_sizes:
            for name in engines:
                samples[(name, bs)].append(step(name, bs))
    return samples


def engine_step_ms(engine: Engine, bs: int, context: int, steps: int, lora=None) -> float:
    """ms per decode step of the whole Engine.generate loop at batch `bs`: the difference of two runs
    of 4 and 4 + steps tokens, so the prefill (a prefix-cache hit in both) cancels."""
    prompts = workload.prompts([context] * bs, int(engine.runner.hf_config.vocab_size))
    _generate(engine, prompts, 4, lora)  # warm-up
    short, long = _generate(engine, prompts, 4, lora), _generate(engine, prompts, 4 + steps, lora)
    return (long - short) * 1e3 / steps


def replay_ms(engine: Engine, bs: int, reps: int = 50) -> float | None:
    """Device ms of one replay of the captured LoRA-less decode graph for `bs` requests, replays back
    to back after a generate left its inputs in place; None without graphs."""
    from backplane.contracts.batch import ForwardMode
    from backplane.executor.graph_sizes import padded_size

    graphs = engine.runner.graph_runner
    if graphs is None or engine.runner.device.type != "cuda":
        return None
    size = padded_size(bs, graphs.sizes)
    keys = [k for k in graphs.graphs if k.mode is ForwardMode.DECODE and k.batch_size == size]
    return events_ms(graphs.graphs[min(keys, key=lambda k: len(k.extras))].replay, reps) if keys else None


def graph_capture(engine: Engine) -> dict:
    """What the engine's graph capture took (seconds, graph pool and device megabytes), the graphs
    captured, the decode batch sizes, and the extend graphs' capture kind ("full", "piecewise", None
    for none), token buckets and request slots."""
    from backplane.contracts.batch import ForwardMode

    graphs = engine.runner.graph_runner
    if graphs is None:
        return {"capture_s": None, "graph_mb": None, "device_mb": None, "graphs": 0, "sizes": [], "extend": None,
                "extend_buckets": [], "extend_sizes": []}
    return {"capture_s": graphs.capture_seconds, "graph_mb": graphs.graph_memory_bytes / 2**20,
            "device_mb": graphs.device_memory_bytes / 2**20, "graphs": len(graphs.graphs), "sizes": graphs.sizes,
            "extend": graphs.kinds.get(ForwardMode.EXTEND), "extend_buckets": graphs.extend_buckets,
            "extend_sizes": graphs.extend_sizes}


def profile_step(engine: Engine, bs: int, context: int, steps: int = 32, lora=None, every_kernel: bool = False) -> dict:
    """Where one decode step goes (torch.profiler over a generate of 1 + steps tokens less one of 1
    token, per step): wall ms, device kernel ms, the rest (host work the device waits for, launch
    gaps), launches, the top kernels and the top idle gaps by the operations around them.
    every_kernel: also "kernels", every kernel per step as (full name, ms, count), slowest first; on a
    device with no kernel events (CPU) the host ops by self CPU time stand for them (kernel_ms too)."""
    prompts = workload.prompts([context] * bs, int(engine.runner.hf_config.vocab_size))
    _generate(engine, prompts, 1 + steps, lora)  # warm-up
    runs = []
    for n in (1, 1 + steps):
        prof, wall = profiled(lambda n=n: _generate(engine, prompts, n, lora), engine.runner.device)
        prof = without_annotations(prof)  # record_function ranges are not device work
        kernels = {name: (ms, count) for name, ms, count in device_kernels(prof)}
        if every_kernel and engine.runner.device.type != "cuda":
            kernels = _host_self({"events": [e for e in prof.events() if not _on_device(e)]})
        runs.append((wall, kernels, device_gaps(prof)))
    (short_wall, short, short_gaps), (long_wall, long, long_gaps) = runs
    kernels, gaps = _per_step(long, short, steps), _per_step(long_gaps, short_gaps, steps)
    wall, device = (long_wall - short_wall) * 1e3 / steps, sum(ms for ms, _ in kernels.values())
    return {"wall_ms": wall, "kernel_ms": device, "host_or_gap_ms": wall - device,
            "launches": sum(n for _, n in kernels.values()), "top_kernels": _top(kernels, 8), "top_gaps": _top(gaps, 6),
            **({"kernels": _top(kernels, len(kernels), width=None)} if every_kernel else {})}


def profile_request(request: Callable[[], object], device: torch.device | str,
                    prepare: Callable[[], object] = lambda: None, top: int = 8) -> dict:
    """Where one request() goes, prepare() run before each of two profiled runs: request_split of the
    first, and from the second, under the Python tracer (its overhead in every time of that run), the
    top Python functions by self time (top_python)."""
    def marked():
        with torch.profiler.record_function(REQUEST):
            return request()

    prepare()
    ops = request_split(profiled(marked, device)[0], top)
    prepare()
    stacks = profiled(marked, device, with_stack=True)[0]
    return ops | {"top_python": _top(_host_self(_request_host(stacks), python=True), top)}


def request_split(prof, top: int = 8) -> dict:
    """A profiled request (the REQUEST range) in the profiler's clock: wall ms; the device's busy ms,
    its idle ms between its first and last operation, before the first (lead_ms: host work nothing
    overlaps) and after the last (tail_ms); kernels, host-to-device copies (h2d, h2d_pageable: from
    pageable memory), device-to-host copies (d2h), synchronising runtime calls (syncs: SYNC_CALLS) and
    item() calls (items); the top host ops by self CPU time, the top idle gaps and the top kernels,
    each (name, ms, count)."""
    host = _request_host(prof)
    start, end = host.pop(REQUEST)
    # NOTE: on CUDA the REQUEST range comes back as a device event too (spanning the request's
    # kernels), dropped here: it would count as device work and hide the idle time.
    prof = without_annotations(prof)
    device = sorted((e.time_range.start, e.time_range.end, e.key) for e in prof.events() if _on_device(e))
    first, last = (device[0][0], max(e for _, e, _ in device)) if device else (end, end)
    busy, calls = _busy_us(device), collections.Counter(e.name for e in host["events"])
    copies = [name for _, _, name in device if name.startswith("Memcpy")]
    kernels = {name: (ms, n) for name, ms, n in device_kernels(prof) if not name.startswith(("Memcpy", "Memset"))}
    return {"wall_ms": (end - start) / 1e3, "device_busy_ms": busy / 1e3, "device_idle_ms": (last - first - busy) / 1e3,
            "lead_ms": (first - start) / 1e3, "tail_ms": max(end - last, 0) / 1e3,
            "kernels": sum(n for _, n in kernels.values()), "h2d": sum("HtoD" in c for c in copies),
            "h2d_pageable": sum("HtoD" in c and "Pageable" in c for c in copies),
            "d2h": sum("DtoH" in c for c in copies), "syncs": sum(calls[c] for c in SYNC_CALLS),
            "items": calls["aten::_local_scalar_dense"], "top_ops": _top(_host_self(host), top),
            "top_gaps": _top(device_gaps(prof), top), "top_kernels": _top(kernels, top)}


def _on_device(event) -> bool:
    return str(getattr(event, "device_type", "")).endswith("CUDA")


def _request_host(prof) -> dict:
    """{REQUEST: (start, end) in us, "events": the host events that start within it, the range's own excepted}."""
    events = [e for e in prof.events() if not _on_device(e)]
    (mark,) = [e for e in events if e.name == REQUEST]
    start, end = mark.time_range.start, mark.time_range.end
    inside = [e for e in events if e is not mark and start <= e.time_range.start <= end]
    return {REQUEST: (start, end), "events": inside}


def _host_self(host: dict, python: bool = False) -> dict[str, tuple[float, int]]:
    """{name: (self CPU ms, calls)} of the host events: Python functions with `python`, else the ops."""
    out: dict[str, tuple[float, int]] = {}
    for e in host["events"]:
        if bool(getattr(e, "is_python_function", False)) == python:
            ms, n = out.get(e.name, (0.0, 0))
            out[e.name] = (ms + e.self_cpu_time_total / 1e3, n + 1)
    return out


def _busy_us(ops: list[tuple[float, float, str]]) -> float:
    """Microseconds when at least one of the (start, end, name) operations, sorted by start, runs."""
    busy, until = 0.0, None
    for start, end, _ in ops:
        if until is None or start > until:
            busy, until = busy + end - start, end
        elif end > until:
            busy, until = busy + end - until, end
    return busy


def _per_step(long: dict, short: dict, steps: int) -> dict[str, tuple[float, float]]:
    """{name: (ms, count)} of the long run less the short one, per decode step."""
    return {k: ((ms - short.get(k, (0.0, 0))[0]) / steps, (n - short.get(k, (0.0, 0))[1]) / steps)
            for k, (ms, n) in long.items()}


def _top(rows: dict[str, tuple[float, float]], n: int, width: int | None = 70) -> list[tuple[str, float, float]]:
    return [(k[:width], ms, count) for k, (ms, count) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:n]]
