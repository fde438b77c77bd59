"""The engine's host cost of one request outside the model: Engine.generate(max_new_tokens=1) on an
engine whose model forward is a stub handing back fixed logits (no layer runs), so what is timed is
the engine's own work per request: the request objects, admission and the radix-cache match,
building the batch, the runner's planning around the model, sampling, finishing, the radix insert
and release, the output.

Scenarios as bench/ttft.py names them: fresh-N (a fresh N-token prompt on an emptied cache) and
repeat-N (the same N-token prompt sent again: all but its last token found in the cache), and for
scale one decode step at --decode-context (decode@N: generate of 1 + --decode-steps tokens less one
of 1 token, per step). Each request is timed alone (the device synchronised around it), on an
emptied cache with the scenario's prefix cached first (untimed); the medians are of --requests
requests in each of --rounds rounds, scenarios interleaved (one untimed warm-up round first).

--pressure BS...: a decode step's host ms at batch size BS on a full KV pool (pressure@BS), where
every step must evict from the radix cache to find its BS slots (the steady state of a server whose
cache has filled). On an engine of its own whose pool holds PRESSURE_POOL_REQUESTS x the largest BS
requests of --pressure-prompt + 1 + --pressure-steps tokens: the cache is emptied and filled again
with such requests (distinct prompts) until no request's worth of slots is free, then BS fresh
prompts are timed generating 1 + --pressure-steps tokens, less the same after the same fill
generating 1, per step (a full garbage collection before each timed run). One sample per BS in each
round, batch sizes interleaved.

Then three passes that explain each request's time, none of them in the medians: per phase, each phase's own
time (its callees that are phases excluded) summed over the timed functions of the scheduler loop
("loop": what no phase covers: generate's and the step's own code); --profile N: cProfile's top N
functions by own time per request; and every place a tensor is read on the host (item, tolist,
cpu, bool, int, float, numpy, equal) and every explicit CUDA synchronisation, with its call site: on a
GPU a read of a device tensor waits for the device (a sync); on CPU every tensor is a host tensor, so
the list is every candidate.

    python -m bench.host_path                                 # tiny-llama on CPU, seconds
    python -m bench.host_path --fresh 128 --repeat 512 --profile 20
    python -m bench.host_path --fresh --repeat --decode-context 0 --pressure 64 256
"""

from __future__ import annotations

import argparse
import cProfile
import collections
import contextlib
import functools
import gc
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from backplane import Engine
from backplane.contracts.batch import ForwardMode
from backplane.contracts.model import ModelOutput
from bench import report, steps, ttft, workload

COLUMNS = [("scenario", "scenario", ""), ("computed", "computed", ""), ("median ms", "median_ms", ".3f"),
           ("min round ms", "min_round_ms", ".3f"), ("max round ms", "max_round_ms", ".3f"),
           ("requests", "requests", "d")]
READ_NAMES = frozenset({"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "equal"})
ROOT = str(Path(__file__).resolve().parents[1])
FILL_SEEDS = 1 << 30  # fill_cache's prompts' seeds start here: none is a timed request's
PRESSURE_POOL_REQUESTS = 4  # --pressure's pool: the running batch's requests and 3 times as many cached
SYNC_CALLS = ((torch.cuda.Event, "synchronize", "Event.synchronize"), (torch.cuda.Stream, "synchronize",
              "Stream.synchronize"), (torch.cuda, "synchronize", "cuda.synchronize"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = report.parser(__doc__)
    p.set_defaults(device="cpu")
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--fresh", type=int, nargs="*", default=[128, 512], metavar="N", help="fresh prompts of N tokens")
    p.add_argument("--repeat", type=int, nargs="*", default=[512], metavar="N", help="an N-token prompt sent again")
    p.add_argument("--decode-context", type=int, default=128,
                   help="also a decode step's host ms at this context (0: none), from generate lengths 1 and 1 + --decode-steps")
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5, help="timed rounds, after one warm-up round")
    p.add_argument("--requests", type=int, default=40, help="timed requests per scenario and round")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile's top N functions per scenario")
    p.add_argument("--pressure", type=int, nargs="*", default=[], metavar="BS",
                   help="also a decode step's host ms at batch size BS on a full KV pool (every step evicts)")
    p.add_argument("--pressure-prompt", type=int, default=64, help="prompt tokens of --pressure's requests")
    p.add_argument("--pressure-steps", type=int, default=32, help="decode steps of --pressure's requests")
    p.add_argument("--real-model", action="store_true",
                   help="keep the model and its graphs (no stub): on a GPU each phase is then the host's time "
                        "around the real forward, and the waits for the device land in 'read tokens'")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--device-ops", action="store_true",
                   help="list every operation on a device tensor outside a graph replay, and every "
                        "host-to-device copy from pageable memory, by call site (per request)")
    ns = p.parse_args(argv)
    ns.scenarios = [ttft.Scenario("fresh", 0, n) for n in ns.fresh] + [ttft.Scenario("repeat", n - 1, 1)
                                                                        for n in ns.repeat]
    ns.scenarios += [ttft.Scenario("decode", ns.decode_context, 0)] if ns.decode_context else []
    return ns


# -- the stub model ---------------------------------------------------------------------------------

class StubForward:
    """A model's forward that only hands back fixed logits: [rows, vocab] fp32 on the model's device,
    one row per request for extend and decode (LogitsProcessor's rows), one per token otherwise."""

    def __init__(self, vocab: int, device: torch.device, max_rows: int = 256):
        gen = torch.Generator().manual_seed(0)
        self.logits = torch.randn(max_rows, vocab, generator=gen).to(device)

    def __call__(self, batch, *args, **kwargs) -> ModelOutput:
        if batch.logits_indices is not None:
            rows = batch.logits_indices.numel()
        elif batch.forward_mode in (ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND, ForwardMode.DECODE):
            rows = batch.batch_size
        else:
            rows = batch.input_ids.numel()
        return ModelOutput(logits=self.logits[:rows])


@contextlib.contextmanager
def stub_model(engine: Engine):
    """Within the block, the engine's model forward is a StubForward (an instance attribute shadows
    the module's forward; graph replays, which would not call it, are turned off too)."""
    runner = engine.runner
    model, graphs = runner.model, runner.graph_runner
    model.forward = StubForward(int(runner.hf_config.vocab_size), runner.device)
    runner.graph_runner = None
    try:
        yield
    finally:
        del model.forward
        runner.graph_runner = graphs


# -- timing -----------------------------------------------------------------------------------------

def one_request(engine: Engine, sc: ttft.Scenario, seed: int) -> tuple[Callable[[], object], Callable[[], None]]:
    """(the request of scenario `sc`, what prepares the cache for it)."""
    setup, prompt = ttft.request_prompts(engine, sc, seed)
    params = steps.greedy(1)
    return (lambda: steps.timed_generate(engine, [prompt], params)), (lambda: ttft.reset(engine, setup))


def time_request(engine: Engine, sc: ttft.Scenario, seed: int, decode_steps: int) -> tuple[float, int | None]:
    """(ms of one request of `sc` on a prepared cache, the prompt tokens it computed); for a decode
    scenario (ms of one decode step: a fresh prompt's generate of 1 + decode_steps tokens less one of 1
    token, per step, None)."""
    if sc.kind == "decode":
        prompt = workload.prompts([sc.prefix], int(engine.runner.hf_config.vocab_size), seed=seed)[0]
        seconds = []
        for n in (1, 1 + decode_steps):
            engine.flush_cache()
            seconds.append(steps.timed_generate(engine, [prompt], steps.greedy(n))[0])
        return (seconds[1] - seconds[0]) * 1e3 / decode_steps, None
    request, prepare = one_request(engine, sc, seed)
    prepare()
    before = engine.stats()["prefix_cache"]["prefill_tokens"]
    seconds = request()[0]
    return seconds * 1e3, engine.stats()["prefix_cache"]["prefill_tokens"] - before


def measure(engine: Engine, ns: argparse.Namespace) -> list[dict]:
    """One row per scenario: the median ms of every timed request, each round's median, the tokens computed."""
    samples = {sc: [[] for _ in range(ns.rounds + 1)] for sc in ns.scenarios}
    computed = {sc: set() for sc in ns.scenarios}
    for r in range(ns.rounds + 1):  # round 0 warms up and is dropped
        for sc in ns.scenarios:
            for i in range(ns.requests):
                ms, n = time_request(engine, sc, 1000 * r + i, ns.decode_steps)
                samples[sc][r].append(ms)
                computed[sc].add(n)
    return [{"scenario": sc.name, "kind": sc.kind, "prefix": sc.prefix, "new": sc.new,
             "computed": " ".join(str(n) for n in sorted(computed[sc]) if n is not None) or None,
             **medians(samples[sc][1:])} for sc in ns.scenarios]


def medians(rounds: list[list[float]]) -> dict:
    """The median of every sample of the timed rounds, each round's median, their extremes and the count."""
    per_round = [statistics.median(ms) for ms in rounds]
    return {"median_ms": statistics.median(ms for one in rounds for ms in one), "round_medians_ms": per_round,
            "min_round_ms": min(per_round), "max_round_ms": max(per_round), "requests": sum(len(one) for one in rounds)}


# -- decode under a full pool -----------------------------------------------------------------------

def pressure_settings(ns: argparse.Namespace) -> dict:
    """--pressure's engine: room for the largest batch and PRESSURE_POOL_REQUESTS times its requests."""
    largest = max(ns.pressure)
    per_request = ns.pressure_prompt + 1 + ns.pressure_steps
    return dict(model=ns.model, device=ns.device, max_running_requests=largest,
                max_total_tokens=PRESSURE_POOL_REQUESTS * largest * per_request)


def fill_cache(engine: Engine, ns: argparse.Namespace, seed: int) -> None:
    """An emptied cache filled again with requests of --pressure's shape (distinct prompts, in batches of
    the largest BS) until less than one request's tokens are free in the pool."""
    engine.flush_cache()
    vocab, pool = int(engine.runner.hf_config.vocab_size), engine.runner.token_to_kv_pool
    per_request = ns.pressure_prompt + 1 + ns.pressure_steps
    for batch in range(PRESSURE_POOL_REQUESTS + 2):
        if pool.num_free < per_request:
            return
        fill = workload.prompts([ns.pressure_prompt] * max(ns.pressure), vocab, seed=seed + batch)
        steps.timed_generate(engine, fill, steps.greedy(1 + ns.pressure_steps))
    raise RuntimeError(f"--pressure: the cache did not fill the pool ({pool.num_free} slots still free)")


def pressure_step_ms(engine: Engine, ns: argparse.Namespace, bs: int, seed: int) -> float:
    """Host ms of one decode step of `bs` fresh requests on a full pool: generate of 1 + --pressure-steps
    tokens less one of 1 token, each after the same fill, per step."""
    prompts = workload.prompts([ns.pressure_prompt] * bs, int(engine.runner.hf_config.vocab_size), seed=seed)
    seconds = []
    for n in (1, 1 + ns.pressure_steps):
        fill_cache(engine, ns, seed=FILL_SEEDS + 100 * seed)  # no fill prompt is one of the timed ones
        gc.collect()  # NOTE: a full collection inside a timed run (~120 ms on the dev CPU) would swamp its steps
        seconds.append(steps.timed_generate(engine, prompts, steps.greedy(n))[0])
    return (seconds[1] - seconds[0]) * 1e3 / ns.pressure_steps


def measure_pressure(ns: argparse.Namespace) -> list[dict]:
    """One row per --pressure batch size: pressure_step_ms in each round (batch sizes interleaved; the
    first round warms up and is dropped)."""
    samples = {bs: [[] for _ in range(ns.rounds + 1)] for bs in ns.pressure}
    engine = Engine(**pressure_settings(ns))
    try:
        with stub_model(engine):
            for r in range(ns.rounds + 1):
                for bs in ns.pressure:
                    samples[bs][r].append(pressure_step_ms(engine, ns, bs, seed=100 * r + bs))
    finally:
        engine.shutdown()
    return [{"scenario": f"pressure@{bs}", "kind": "pressure", "batch_size": bs, "prefix": ns.pressure_prompt,
             "new": 1 + ns.pressure_steps, "computed": None, **medians(samples[bs][1:])} for bs in ns.pressure]


# -- phases -----------------------------------------------------------------------------------------

class Phases:
    """Self time per phase: a wrapped function's time less that of the wrapped functions it calls."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter[str] = collections.Counter()
        self.on = False  # off: the wrapped functions run untimed (a request's preparation)
        self._inner: list[float] = []

    def wrap(self, fn: Callable, label: str) -> Callable:
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            self._inner.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                inner = self._inner.pop()
                self.seconds[label] += spent - inner
                self.calls[label] += 1
                if self._inner:
                    self._inner[-1] += spent
        return timed


def phase_targets(engine: Engine) -> list[tuple[object, str, str]]:
    """(owner, attribute, phase) of every timed function: instances, modules or classes."""
    import backplane.scheduler.launcher as launcher_module
    import backplane.scheduler.scheduler as scheduler_module
    from backplane.scheduler.overlap import LaunchedStep

    sched, launcher, cache = engine.scheduler, engine.scheduler.launcher, engine.scheduler.prefix_cache
    stubbed = "forward" in vars(engine.runner.model)  # stub_model's instance attribute
    return [(engine, "_make_requests", "requests"), (sched, "add", "queue"),
            (scheduler_module, "admit_prefill", "admission"), (cache, "match", "radix match"),
            (launcher_module, "build_extend_batch", "build batch"), (launcher_module, "build_decode_batch", "build batch"),
            (launcher.decode_state, "build", "build batch"),
            (engine.runner, "forward", "runner forward" + (" (stub model)" if stubbed else "")),
            (launcher.sampling, "get", "sampling setup"),
            (launcher_module, "sample", "sample"), (launcher, "_launch", "launch tokens' copy"),
            (cache, "cache_prefilled", "radix insert"), (LaunchedStep, "new_tokens", "read tokens"),
            (sched, "_advance", "finish"), (cache, "release", "radix release"), (engine, "_output", "output")
            ] + replay_targets(engine)


def replay_targets(engine: Engine) -> list[tuple[object, str, str]]:
    """The graph runner's parts of a replay (on an engine with graphs): the padded inputs' copy, the
    contributors' and the attention backend's replay metadata, and the graph launch itself."""
    import backplane.executor.graph_runner as graph_module

    graphs = engine.runner.graph_runner
    if graphs is None:
        return []
    return [(graph_module, "pad_into", "replay inputs (pad_into)"),
            (graphs, "prepare_contributors", "replay contributors"),
            (graphs.backend, "init_metadata_for_replay", "replay attention metadata"),
            (torch.cuda.CUDAGraph, "replay", "graph launch")]


def phase_split(engine: Engine, sc: ttft.Scenario, n: int) -> list[tuple[str, float, float]]:
    """(phase, us per request, calls per request) over n requests of `sc`, slowest first, "loop" the rest."""
    phases, total = Phases(), 0.0
    with contextlib.ExitStack() as stack:
        from unittest import mock

        for owner, attr, label in phase_targets(engine):
            stack.enter_context(mock.patch.object(owner, attr, phases.wrap(getattr(owner, attr), label)))
        for i in range(n):
            request, prepare = one_request(engine, sc, seed=7000 + i)
            prepare()
            phases.on = True
            start = time.perf_counter()
            request()
            total += time.perf_counter() - start
            phases.on = False
    rows = {label: (s * 1e6 / n, phases.calls[label] / n) for label, s in phases.seconds.items()}
    rows["loop"] = ((total - sum(phases.seconds.values())) * 1e6 / n, 1.0)
    return sorted(((k, us, calls) for k, (us, calls) in rows.items()), key=lambda r: -r[1])


# -- cProfile ---------------------------------------------------------------------------------------

def profile_top(engine: Engine, sc: ttft.Scenario, n: int, top: int) -> list[tuple[str, float, float]]:
    """cProfile's top functions of n requests of `sc` by own time: (function, us per request, calls per request)."""
    prof = cProfile.Profile()
    for i in range(n):
        request, prepare = one_request(engine, sc, seed=8000 + i)
        prepare()
        prof.enable()
        request()
        prof.disable()
    stats = pstats.Stats(prof).stats
    rows = [(_where(file, line, fn), tt * 1e6 / n, calls / n) for (file, line, fn), (_, calls, tt, _, _) in stats.items()]
    return sorted(rows, key=lambda r: -r[1])[:top]


def _where(file: str, line: int, fn: str) -> str:
    name = file[len(ROOT) + 1:] if file.startswith(ROOT) else Path(file).name if file != "~" else ""
    return f"{name}:{line}({fn})" if name else fn


# -- host reads of tensors and synchronisations -----------------------------------------------------

class HostReads(TorchFunctionMode):
    """Counts every host read of a tensor (READ_NAMES) and every explicit CUDA synchronisation
    (SYNC_CALLS, patched while the mode is on) by the project's call site that made it."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self._patches = contextlib.ExitStack()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READ_NAMES:
            device = next((str(a.device) for a in args if isinstance(a, torch.Tensor)), "?")
            self.sites[(name, device, _call_site())] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        from unittest import mock

        for owner, attr, name in SYNC_CALLS:
            self._patches.enter_context(mock.patch.object(owner, attr, self._counted(getattr(owner, attr), name)))
        return super().__enter__()

    def __exit__(self, *exc):
        self._patches.close()
        return super().__exit__(*exc)

    def _counted(self, fn: Callable, name: str) -> Callable:
        def call(*args, **kwargs):
            self.sites[(name, "cuda", _call_site())] += 1
            return fn(*args, **kwargs)
        return call


@functools.cache
def _project_dirs() -> tuple[str, ...]:
    """The folders of backplane and its bundled plugins, wherever they are installed."""
    import backplane
    import backplane.plugins

    return tuple(str(Path(m.__file__).resolve().parent) + "/" for m in (backplane, backplane.plugins))


def _call_site(depth: int = 2) -> str:
    """file:line (function) of the innermost frame in backplane or its plugins (named from the
    package folder's parent, e.g. core/scheduler/overlap.py), `depth` frames up from here and beyond."""
    dirs, frame = _project_dirs(), sys._getframe(depth)
    while frame is not None:
        file = frame.f_code.co_filename
        top = next((d for d in dirs if file.startswith(d)), None)
        if top is not None:
            parent = str(Path(top).parent)
            return f"{file[len(parent) + 1:]}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "?"


def _requests_under(mode, engine: Engine, sc: ttft.Scenario, n: int, seed: int):
    """`mode` (a torch function or dispatch mode) after n requests of `sc`, each run inside it (its
    cache preparation outside)."""
    for i in range(n):
        request, prepare = one_request(engine, sc, seed=seed + i)
        prepare()
        with mode:
            request()
    return mode


def host_reads(engine: Engine, sc: ttft.Scenario, n: int) -> list[tuple[str, str, str, float]]:
    """(read or synchronisation, tensor device, call site, per request) of n requests of `sc`, by call site."""
    reads = _requests_under(HostReads(), engine, sc, n, seed=9000)
    return sorted(((name, dev, site, k / n) for (name, dev, site), k in reads.sites.items()), key=lambda r: r[2])


# -- device operations outside graph replays --------------------------------------------------------

class DeviceOps(TorchDispatchMode):
    """Counts every aten operation that touches a tensor on a non-CPU device (a kernel launch, a copy or
    an allocation on the device: host time per operation, and a gap in the device's timeline while
    the host makes the next one) and every copy from pageable host memory onto the device, by the
    project's call site. A graph replay is one launch, invisible to the dispatcher; meta-data only
    operations (views) are counted too, marked as such, since each costs host time."""

    HOST = ("cpu", "meta")  # device types that are not a device here (tests count meta as one)
    VIEWS = frozenset({"view", "slice", "select", "as_strided", "unsqueeze", "squeeze", "expand", "t",
                       "transpose", "permute", "alias", "detach", "_unsafe_view", "reshape", "narrow"})

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter[tuple[str, str]] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        out = func(*args, **kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        tensors += [o for o in outs if isinstance(o, torch.Tensor)]
        on_device = any(t.device.type not in self.HOST for t in tensors)
        if on_device:
            name = func.overloadpacket.__name__
            pageable = name in ("copy_", "_to_copy") and any(
                t.device.type == "cpu" and not t.is_pinned() for t in tensors)
            label = name + (" (pageable h2d)" if pageable else " (view)" if name in self.VIEWS else "")
            self.sites[(label, _call_site(depth=1))] += 1
        return out


def device_ops(engine: Engine, sc: ttft.Scenario, n: int) -> list[tuple[str, str, float]]:
    """(operation, call site, per request) of n requests of `sc`, in call-site order."""
    ops = _requests_under(DeviceOps(), engine, sc, n, seed=9500)
    return sorted(((op, site, k / n) for (op, site), k in ops.sites.items()), key=lambda r: r[1])


# -- report -----------------------------------------------------------------------------------------

def explain(engine: Engine, ns: argparse.Namespace) -> None:
    """Adds each row's phases, host reads and (with --profile) cProfile's top functions, and prints them."""
    n = max(ns.requests, 10)
    for sc, row in zip(ns.scenarios, ns.rows):
        if sc.kind == "decode":  # its time is a difference of two requests: nothing to split
            continue
        row["phases"] = phase_split(engine, sc, n)
        row["host_reads"] = host_reads(engine, sc, 3)
        print(f"{sc.name} phases (us per request, own time): "
              + ", ".join(f"{k} {us:.1f}" + (f" x{c:g}" if c != 1 else "") for k, us, c in row["phases"]))
        print(f"{sc.name} host reads of tensors and syncs per request: "
              + ("; ".join(f"{name} ({dev}) {site} x{k:g}" for name, dev, site, k in row["host_reads"]) or "none"))
        if ns.device_ops:
            row["device_ops"] = device_ops(engine, sc, 3)
            print(f"{sc.name} device operations outside graph replays per request (op, call site, count):")
            for op, site, k in row["device_ops"]:
                print(f"  x{k:<5g} {op:34s} {site}")
        if ns.profile:
            row["top_python"] = profile_top(engine, sc, n, ns.profile)
            print(f"{sc.name} cProfile top {ns.profile} (us per request, own time):")
            for fn, us, calls in row["top_python"]:
                print(f"  {us:8.1f}  x{calls:<6g} {fn}")


def measure_scenarios(ns: argparse.Namespace) -> None:
    """ns.rows: the scenarios' rows, explained (explain)."""
    longest = max(sc.prefix + max(sc.new, 1 + ns.decode_steps) for sc in ns.scenarios)
    engine = Engine(ns.model, device=ns.device, max_running_requests=16, max_total_tokens=4 * longest + 1024,
                    attention_backend=ns.attention_backend)
    try:
        with contextlib.nullcontext() if ns.real_model else stub_model(engine):
            ns.rows = measure(engine, ns)
            explain(engine, ns)
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> dict:
    ns = parse_args(argv)
    ns.rows = []
    if ns.scenarios:
        measure_scenarios(ns)
    if ns.pressure:
        ns.rows += measure_pressure(ns)
    args = {k: v for k, v in vars(ns).items() if k not in ("scenarios", "rows", "out")}  # no machine paths
    # the backend in the name: one call may measure several, each into its own file
    subject = ns.model + ("" if ns.attention_backend == "auto" else f"-{ns.attention_backend}")
    report.write_result("host-path", subject, {"args": args, "rows": ns.rows}, ns.out, ns.device)
    print(report.table(ns.rows, COLUMNS, f"host ms per request outside the model ({ns.model}, {ns.device}, "
                                         "generate max_new_tokens=1, stub forward; decode@N: per decode step; "
                                         "pressure@BS: per decode step of BS requests on a full pool)"))
    return {"rows": ns.rows}


if __name__ == "__main__":
    main()
