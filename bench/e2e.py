"""End-to-end offline throughput against the floor: Engine.generate over whole workloads, graphs up to
the running batch, per attention backend and radix-cache setting.

Workloads of --requests requests: "fixed" (1024 input / 256 output tokens), "sharegpt-like" (seeded
log-normal lengths), "shared-prefix" (--groups groups sharing a prefix, each request its own suffix,
shuffled; --prefix-shape) and "distinct" (as many prompts of the same length, nothing shared). Each
is timed --repeats times on an emptied prefix cache and a fresh slot order; the median run is kept.
Reported: output tokens/s, median TPOT and TTFT, the prompt tokens prefill computed, the floor (every
decode step reads the weights once and the running requests' KV at the card's copy bandwidth, the
prefill does its matmul FLOPs at the bf16 matmul peak; all requests in one batch) and the share of it.

Profile (--profile WORKLOAD...): after the timed runs, the workload once more on an emptied cache
under torch.profiler (its first --profile-steps scheduler steps: the default 2000 takes a whole run of
256 requests, ~530 steps on sharegpt-like, by estimate ~2x10^5 trace events and some seconds to parse
them; a bound for longer runs, whose floors then come from the steps profiled). Each scheduler
step is tagged from the outside (StepTags: profiler ranges around the engine's `scheduler.step` and
its launcher's `forward_prefill` and `decode`) as a prefill step, a decode step or "other" (launched
nothing: the last step's read under overlap). Per kind: steps, tokens, wall ms, host ms (wall less
the host's waits in synchronising calls), device busy and idle ms inside the kind's steps, device ms
of the operations the kind's steps launched (attention / GEMM / other by kernel name:
bench.timing.kernel_group), and the floor of the batches as run (the floor's formula per step) next
to the measured time; decode steps also by batch size. Then the device's total busy and idle time,
the top idle gaps and the top kernels. The profiler's overhead is in its times (the timed run is
printed next to it); the JSON row's "profile" keeps every step's figures.

    python -m bench.e2e --model llama-3.2-1b --backends triton flashinfer --repeats 3
    python -m bench.e2e --workloads shared-prefix distinct --cache on off           # the radix cache's gain
    python -m bench.e2e --workloads sharegpt-like --extend-graph on off             # extend graphs' gain
    python -m bench.e2e --workloads sharegpt-like --backends triton --profile sharegpt-like  # where the time goes
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from typing import Callable

import torch

from backplane import Engine, SamplingParams
from bench import report, steps, timing
from bench.timing import MATMUL_PEAK_FLOP_S, copy_tb_s, matmul_peak_flop_s, sync
from bench.workload import model_sizes, prompts, shapes, shared_prefix, weight_bytes

COLUMNS = [("workload", "workload", ""), ("backend", "backend", ""), ("quant", "quantization", ""), ("kv", "kv_cache_dtype", ""),
           ("cache", "cache", ""),
           ("extend graph", "extend_graph", ""), ("tok/s", "tok_s", ".0f"),
           ("TPOT ms", "tpot_ms", ".2f"), ("TTFT ms", "ttft_ms", ".0f"), ("prefill tokens", "prefill_tokens", "d"),
           ("floor tok/s", "floor_tok_s", ".0f"), ("of floor", "of_floor", ".0%"), ("runs s", "runs", "")]
PROFILE_COLUMNS = [("workload", "workload", ""), ("backend", "backend", ""), ("steps of", "kind", ""), ("steps", "steps", "d"),
                   ("tokens", "tokens", "d"), ("wall ms", "wall_ms", ".1f"), ("host ms", "host_ms", ".1f"),
                   ("wait ms", "wait_ms", ".1f"), ("busy ms", "device_busy_ms", ".1f"), ("idle ms", "device_idle_ms", ".1f"),
                   ("kernel ms", "kernel_ms", ".1f"), ("attn ms", "attention_ms", ".1f"), ("gemm ms", "gemm_ms", ".1f"),
                   ("floor ms", "floor_ms", ".1f"), ("x floor", "x_floor", ".2f")]
STEP = "bench.step"  # the profiler range of one scheduler step (--profile)
LAUNCH = {"prefill": "bench.prefill", "decode": "bench.decode"}  # the range around the launcher's call, inside STEP
KINDS = ("prefill", "decode", "other")
DECODE_BUCKETS = (16, 64, 128)  # decode steps by batch size: 1-16, 17-64, 65-128, over 128
STEP_FIELDS = ("kind", "batch", "tokens", "wall_ms", "busy_ms", "wait_ms", "launch_ms", "kernel_ms", "floor_ms")  # the JSON's per_step


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = report.parser(__doc__)
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--backends", nargs="+", default=["triton", "flashinfer"])
    p.add_argument("--cache", nargs="+", choices=["on", "off"], default=["on"], help="radix cache settings, each an engine")
    p.add_argument("--extend-graph", nargs="+", choices=["on", "off"], default=["on"],
                   help="extend (prefill) CUDA graphs on or off (--disable-extend-graph), each an engine")
    p.add_argument("--quantization", nargs="+", default=["none"], help="--quantization of each engine (none, fp8, ...)")
    p.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], choices=["auto", "fp8_e4m3"],
                   help="--kv-cache-dtype of each engine (with each --quantization)")
    p.add_argument("--gc-freeze", choices=["on", "off"], default="on",
                   help="the engines' --gc-freeze: an offline job runs one engine until it ends, as a serving "
                        "process does (a full collection of the unfrozen startup heap is ~0.1 s)")
    p.add_argument("--workloads", nargs="+", default=["fixed", "sharegpt-like"],
                   choices=["fixed", "sharegpt-like", "shared-prefix", "distinct"])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--max-running", type=int, default=256)
    p.add_argument("--fixed-shape", type=int, nargs=2, default=(1024, 256), metavar=("INPUT", "OUTPUT"))
    p.add_argument("--groups", type=int, default=8, help="shared-prefix: groups sharing one prefix")
    p.add_argument("--prefix-shape", type=int, nargs=3, default=(2048, 128, 128), metavar=("PREFIX", "SUFFIX", "OUTPUT"))
    p.add_argument("--repeats", type=int, default=1, help="timed runs per workload (the median is kept)")
    p.add_argument("--profile", nargs="+", default=[], metavar="WORKLOAD",
                   help="after the timed runs, run these workloads once more under the profiler (module docstring)")
    p.add_argument("--profile-steps", type=int, default=2000, help="--profile: profile at most this many scheduler steps")
    ns = p.parse_args(argv)
    if any(w not in ns.workloads for w in ns.profile):
        p.error(f"--profile: expected workloads among --workloads {ns.workloads}, got {ns.profile}")
    if ns.profile_steps < 1:
        p.error(f"--profile-steps: expected a positive number of steps, got {ns.profile_steps}")
    return ns


def workload(ns: argparse.Namespace, kind: str, vocab: int) -> tuple[list[list[int]], list[int]]:
    """(prompts, output lengths) of one workload."""
    prefix, suffix, out = ns.prefix_shape
    if kind == "shared-prefix":
        return shared_prefix(ns.groups, ns.requests // ns.groups, prefix, suffix, vocab), [out] * ns.requests
    if kind == "distinct":
        return prompts([prefix + suffix] * ns.requests, vocab, seed=7), [out] * ns.requests
    lengths = shapes(kind, ns.requests, tuple(ns.fixed_shape))
    return prompts([n for n, _ in lengths], vocab), [n for _, n in lengths]


def floor_seconds(lengths: list[tuple[int, int]], weights: int, kv_per_token: int, matmul_params: int, tb_s: float,
                  matmul_peak: float = MATMUL_PEAK_FLOP_S) -> float:
    """Decode: one weight read per step plus the running requests' KV at tb_s; prefill: 2 x params x
    tokens FLOPs at matmul_peak (FLOP/s)."""
    return sum(floor_parts(lengths, weights, kv_per_token, matmul_params, tb_s, matmul_peak).values())


def floor_parts(lengths: list[tuple[int, int]], weights: int, kv_per_token: int, matmul_params: int,
                tb_s: float, matmul_peak: float = MATMUL_PEAK_FLOP_S) -> dict[str, float]:
    """{"decode": seconds, "prefill": seconds} of the floor of (input, output) lengths, all requests in
    one batch: decode step k runs every request with more than k + 1 output tokens (the first comes
    from the prefill) over its input + 1 + k tokens of KV; the prefill computes every input token."""
    decode = sum(decode_floor_s(sum(n_in + 1 + step for n_in, n_out in lengths if n_out - 1 > step), weights, kv_per_token, tb_s)
                 for step in range(max(n_out for _, n_out in lengths) - 1))
    return {"decode": decode, "prefill": prefill_floor_s(sum(n_in for n_in, _ in lengths), matmul_params, matmul_peak)}


def decode_floor_s(context_tokens: int, weights: int, kv_per_token: int, tb_s: float) -> float:
    """One decode step: the weights read once plus `context_tokens` tokens of KV, at tb_s TB/s."""
    return (weights + kv_per_token * context_tokens) / (tb_s * 1e12)


def prefill_floor_s(tokens: int, matmul_params: int, matmul_peak: float = MATMUL_PEAK_FLOP_S) -> float:
    """A prefill of `tokens` tokens: 2 x matmul_params FLOPs each at the matmul peak (FP8's for an FP8 model)."""
    return 2.0 * matmul_params * tokens / matmul_peak


def floor_sizes(engine: Engine, tb_s: float) -> dict:
    """The floor's sizes of an engine's model (floor_seconds' keywords after `lengths`)."""
    runner = engine.runner
    kv_per_token, matmul_params = model_sizes(runner.hf_config, runner.token_to_kv_pool.k_buffers[0].element_size())
    return {"weights": weight_bytes(runner.model), "kv_per_token": kv_per_token, "matmul_params": matmul_params, "tb_s": tb_s,
            "matmul_peak": matmul_peak_flop_s(engine)}


def timed_run(engine: Engine, batch: list[list[int]], params: list[SamplingParams]) -> tuple[float, list, int]:
    """(seconds, outputs, prompt tokens prefill computed) of one generate on an emptied cache and a fresh slot order."""
    engine.flush_cache()
    before = engine.stats()["prefix_cache"]["prefill_tokens"]
    seconds, outs = steps.timed_generate(engine, batch, params)
    return seconds, outs, engine.stats()["prefix_cache"]["prefill_tokens"] - before


def run_workload(ns: argparse.Namespace, engine: Engine, kind: str, tb_s: float) -> dict:
    """One workload on one engine: warm-up (its first requests twice, the second time from the cache),
    then --repeats timed runs; the median run's figures; then, for a --profile workload, its profile."""
    batch, out_lens = workload(ns, kind, int(engine.runner.hf_config.vocab_size))
    params = [steps.greedy(n) for n in out_lens]
    for _ in range(2):
        engine.generate(input_ids=batch[:4], sampling_params=params[:4])
    runs = sorted((timed_run(engine, batch, params) for _ in range(ns.repeats)), key=lambda r: r[0])
    seconds, outs, prefilled = runs[(len(runs) - 1) // 2]
    tokens = sum(len(o.token_ids) for o in outs)
    sizes, lengths = floor_sizes(engine, tb_s), [(len(p), n) for p, n in zip(batch, out_lens)]
    floor = floor_seconds(lengths, **sizes)
    graphs = engine.runner.graph_runner
    row = {"workload": kind, "requests": len(batch), "input_tokens": sum(map(len, batch)), "output_tokens": tokens,
            "seconds": seconds, "runs": " ".join(f"{r[0]:.2f}" for r in runs), "tok_s": tokens / seconds,
            "tpot_ms": statistics.median(o.tpot_s for o in outs if o.tpot_s is not None) * 1e3,
            "ttft_ms": statistics.median(o.ttft_s for o in outs) * 1e3, "prefill_tokens": prefilled,
            "floor_s": floor, "floor_tok_s": tokens / floor, "of_floor": floor / seconds,
            "graphs_cover_batch": graphs is not None and max(graphs.sizes) >= min(len(batch), ns.max_running)}
    if kind in ns.profile:
        try:
            row["profile"] = profile_run(engine, batch, params, sizes, ns.profile_steps) | {
                "workload_floor_ms": {k: v * 1e3 for k, v in floor_parts(lengths, **sizes).items()}}
        except Exception as exc:  # noqa: BLE001 - the timed figures stand without their profile; the row says why
            row["profile"] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"--profile {kind}: failed: {row['profile']['error']}", flush=True)
    return row


def run_engine(ns: argparse.Namespace, backend: str, cache: str, tb_s: float, extend_graph: str = "on",
               quantization: str = "none", kv_cache_dtype: str = "auto") -> list[dict]:
    # Graphs up to the running batch: past --cuda-graph-max-bs (160 by default) a decode step runs
    # eagerly, which on a small model costs several times the replayed step.
    settings = dict(model=ns.model, device=ns.device, attention_backend=backend, max_running_requests=ns.max_running,
                    cuda_graph_max_bs=ns.max_running, disable_radix_cache=cache == "off",
                    disable_extend_graph=extend_graph == "off", quantization=quantization,
                    kv_cache_dtype=kv_cache_dtype, gc_freeze=ns.gc_freeze == "on")
    rows = steps.with_engine(settings, lambda engine: [run_workload(ns, engine, kind, tb_s) for kind in ns.workloads])
    return [r | {"backend": backend, "cache": cache, "extend_graph": extend_graph, "quantization": quantization,
                 "kv_cache_dtype": kv_cache_dtype, "gc_freeze": ns.gc_freeze} for r in rows]


class StepTags:
    """Tags each scheduler step of an engine for the profiler without touching the core: wraps the
    instance's `scheduler.step` (a STEP range) and its launcher's `forward_prefill` and `decode` (a
    LAUNCH range inside the step's), and records each step's kind ("other": it launched no forward,
    e.g. the last step, which only reads the one before under overlap), batch, tokens and floor
    seconds (the floor's formula over the batch as it runs). After `limit` steps it calls stop() and
    tags no more; restore() removes the wrappers."""

    def __init__(self, engine: Engine, sizes: dict, limit: int, stop: Callable[[], None]):
        self.scheduler, self.launcher = engine.scheduler, engine.scheduler.launcher
        self.sizes, self.limit, self.stop = sizes, limit, stop
        self.steps: list[dict] = []
        self.done = False
        self._step, self._prefill, self._decode = self.scheduler.step, self.launcher.forward_prefill, self.launcher.decode
        self.scheduler.step, self.launcher.forward_prefill, self.launcher.decode = self.step, self.forward_prefill, self.decode

    def restore(self) -> None:
        for obj, name in ((self.scheduler, "step"), (self.launcher, "forward_prefill"), (self.launcher, "decode")):
            vars(obj).pop(name, None)

    def step(self):
        if self.done:
            return self._step()
        self.steps.append({"kind": "other", "batch": 0, "tokens": 0, "floor_s": 0.0})
        try:
            with torch.profiler.record_function(STEP):
                return self._step()
        finally:
            if len(self.steps) >= self.limit:
                self.done = True
                self.stop()

    def forward_prefill(self, reqs, chunks):
        if self.done:
            return self._prefill(reqs, chunks)
        tokens = sum(chunks)
        self.steps[-1].update(kind="prefill", batch=len(reqs), tokens=tokens,
                              floor_s=prefill_floor_s(tokens, self.sizes["matmul_params"],
                                                      self.sizes.get("matmul_peak", MATMUL_PEAK_FLOP_S)))
        with torch.profiler.record_function(LAUNCH["prefill"]):
            return self._prefill(reqs, chunks)

    def decode(self, reqs):
        if self.done:
            return self._decode(reqs)
        context = sum(r.num_cached + 1 for r in reqs)  # the KV a request's step reads: its cached tokens and the new one
        s = self.sizes
        self.steps[-1].update(kind="decode", batch=len(reqs), tokens=len(reqs),
                              floor_s=decode_floor_s(context, s["weights"], s["kv_per_token"], s["tb_s"]))
        with torch.profiler.record_function(LAUNCH["decode"]):
            return self._decode(reqs)


def profile_run(engine: Engine, batch: list[list[int]], params: list[SamplingParams], sizes: dict, limit: int) -> dict:
    """The workload once more on an emptied prefix cache, its first `limit` scheduler steps under the
    profiler (StepTags): profile_split, with whole_run (whether the profile holds the whole run)."""
    device, clock = engine.runner.device, {}
    prof = timing.profiler(device)

    def stop():
        sync(device)  # the last profiled step's kernels end inside the profile
        clock["end"], clock["whole"] = time.perf_counter(), not engine.scheduler.has_work
        prof.stop()

    engine.flush_cache()
    tags = StepTags(engine, sizes, limit, stop)
    prof.start()
    try:
        clock["start"] = time.perf_counter()
        steps.timed_generate(engine, batch, params)
        if not tags.done:
            tags.done = True
            stop()
    finally:
        tags.restore()
        if "end" not in clock:  # the run failed: leave no profiler running
            prof.stop()
    print(f"profiled {len(tags.steps)} steps in {clock['end'] - clock['start']:.2f} s; analysing the trace", flush=True)
    return profile_split(prof, tags.steps, clock["end"] - clock["start"]) | {"whole_run": clock["whole"]}


def profile_split(prof, records: list[dict], wall_s: float, top: int = 8) -> dict:
    """A profiled run whose scheduler steps are STEP ranges, `records` StepTags' records of them in
    order, wall_s its host-timed wall: the device's busy and idle time, the split by kind of step
    (step_total) and of decode steps by batch size, every step's figures (per_step: STEP_FIELDS),
    device time by kernel_group, and the top idle gaps and kernels (name, ms, count[, group])."""
    view = timing.without_annotations(prof)
    windows = timing.host_ranges(view, STEP)
    if len(windows) != len(records):
        raise RuntimeError(f"profile: expected {len(records)} '{STEP}' ranges (the steps tagged), got {len(windows)}")
    busy = timing.merged((e.time_range.start, e.time_range.end) for e in view.events() if timing.on_device(e))
    kernels_us, unlinked = timing.launched(view, windows)
    figures = zip(windows, timing.covered(windows, busy), timing.host_time(view, windows, steps.SYNC_CALLS),
                  timing.host_time(view, windows, LAUNCH.values()), kernels_us)
    per_step = [rec | {"wall_us": end - start, "busy_us": b, "wait_us": w, "launch_us": launch, "kernels_us": k}
                for rec, ((start, end), b, w, launch, k) in zip(records, figures)]
    wall_ms, busy_ms = wall_s * 1e3, sum(end - start for start, end in busy) / 1e3
    kinds = {kind: step_total([s for s in per_step if s["kind"] == kind]) for kind in KINDS}
    top_kernels = [(name[:70], ms, n, timing.kernel_group(name)) for name, ms, n in timing.device_kernels(view)]
    groups = collections.Counter()
    for _, ms, _, group in top_kernels:
        groups[group] += ms
    return {"wall_ms": wall_ms, "steps": len(records), "steps_ms": sum(k["wall_ms"] for k in kinds.values()),
            "outside_ms": wall_ms - sum(k["wall_ms"] for k in kinds.values()), "device_busy_ms": busy_ms,
            "device_idle_ms": wall_ms - busy_ms, "kinds": kinds, "decode_by_batch": decode_by_batch(per_step),
            "kernel_groups_ms": dict(groups), "unlinked_kernel_ms": sum(unlinked.values()) / 1e3,
            "top_gaps": [(k[:70], ms, n) for k, (ms, n) in sorted(timing.device_gaps(view).items(), key=lambda kv: -kv[1][0])[:top]],
            "top_kernels": top_kernels[:top],
            "per_step": {"fields": STEP_FIELDS, "rows": [step_row(s) for s in per_step]}}


def step_row(step: dict) -> list:
    """One profiled step's STEP_FIELDS, times in ms to 5 significant digits."""
    ms = [step[k] / 1e3 for k in ("wall_us", "busy_us", "wait_us", "launch_us")] + [sum(step["kernels_us"].values()) / 1e3,
                                                                                   step["floor_s"] * 1e3]
    return [step["kind"], step["batch"], step["tokens"]] + [float(f"{v:.5g}") for v in ms]


def step_total(per_step: list[dict]) -> dict:
    """Sums over some profiled steps: wall ms, host ms (wall less the waits in synchronising calls),
    launch ms (in the launcher's call), device busy and idle ms within the steps, device ms of what
    they launched (kernel_ms; by group: attention_ms, gemm_ms, other_ms), floor ms and wall / floor."""
    ms = {key: sum(s[f"{key}_us"] for s in per_step) / 1e3 for key in ("wall", "busy", "wait", "launch")}
    kernels = collections.Counter()
    for s in per_step:
        kernels.update(s["kernels_us"])
    floor_ms = sum(s["floor_s"] for s in per_step) * 1e3
    kernel_ms = sum(kernels.values()) / 1e3
    return {"steps": len(per_step), "tokens": sum(s["tokens"] for s in per_step), "wall_ms": ms["wall"],
            "host_ms": ms["wall"] - ms["wait"], "wait_ms": ms["wait"], "launch_ms": ms["launch"],
            "device_busy_ms": ms["busy"], "device_idle_ms": ms["wall"] - ms["busy"], "kernel_ms": kernel_ms,
            **{f"{g}_ms": kernels[g] / 1e3 for g in ("attention", "gemm", "other")}, "floor_ms": floor_ms,
            "x_floor": report.ratio(ms["wall"], floor_ms), "kernel_x_floor": report.ratio(kernel_ms, floor_ms)}


def decode_by_batch(per_step: list[dict]) -> dict[str, dict]:
    """step_total of the decode steps by batch size (DECODE_BUCKETS), the buckets that ran."""
    edges = (0, *DECODE_BUCKETS, float("inf"))
    out = {}
    for lo, hi in zip(edges, edges[1:]):
        group = [s for s in per_step if s["kind"] == "decode" and lo < s["batch"] <= hi]
        if group:
            out[f"bs {lo + 1}-{hi}" if hi != float("inf") else f"bs >{lo}"] = step_total(group)
    return out


def floor_line(profile: dict) -> str:
    """"decode: 0.91 s measured vs 0.43 s floor (2.1x; its kernels 0.60 s, 1.4x); prefill: ..."."""
    parts = []
    for kind in ("decode", "prefill"):
        k = profile["kinds"][kind]
        if k["steps"] and k["floor_ms"]:
            parts.append(f"{kind}: {k['wall_ms'] / 1e3:.3f} s measured vs {k['floor_ms'] / 1e3:.3f} s floor "
                         f"({k['x_floor']:.1f}x; its kernels {k['kernel_ms'] / 1e3:.3f} s, {k['kernel_x_floor']:.1f}x)")
    return "; ".join(parts)


def print_profiles(rows: list[dict]) -> None:
    """Each profiled run's totals, floors, top idle gaps and kernels; then one table of every run's
    steps by kind and decode batch size, last."""
    table = []
    for r in rows:
        p, name = r["profile"], f"{r['workload']} {r['backend']} (cache {r['cache']}, extend graph {r['extend_graph']})"
        if "error" in p:
            print(f"\nprofiled {name}: failed: {p['error']}")
            continue
        floor = p["workload_floor_ms"]
        print(f"\nprofiled {name}: wall {p['wall_ms']:.0f} ms (the timed run {r['seconds'] * 1e3:.0f} ms), {p['steps']} steps"
              f"{'' if p['whole_run'] else ' (a prefix: --profile-steps)'}, device busy {p['device_busy_ms']:.0f} ms, "
              f"idle {p['device_idle_ms']:.0f} ms, outside steps {p['outside_ms']:.0f} ms")
        print(f"  {floor_line(p)}")
        print(f"  the workload's floor (floor_seconds): decode {floor['decode'] / 1e3:.3f} s, prefill {floor['prefill'] / 1e3:.3f} s")
        print("  device ms by kernel group: " + ", ".join(f"{g} {ms:.1f}" for g, ms in sorted(p["kernel_groups_ms"].items())))
        print("  top idle gaps: " + "; ".join(f"{k} {ms:.1f} ms x{n}" for k, ms, n in p["top_gaps"][:5]))
        print("  top kernels: " + "; ".join(f"{k} [{g}] {ms:.1f} ms x{n:g}" for k, ms, n, g in p["top_kernels"][:5]))
        label = {"workload": r["workload"], "backend": r["backend"]}
        table += [label | {"kind": kind} | p["kinds"][kind] for kind in KINDS if p["kinds"][kind]["steps"]]
        table += [label | {"kind": f"decode {bucket}"} | t for bucket, t in p["decode_by_batch"].items()]
    print(report.table(table, PROFILE_COLUMNS, "\nprofiled runs by kind of step (profiler overhead included; the JSON row's "
                                               "profile; host = wall less waits; kernel = device ms the steps launched)"))


def gains(rows: list[dict], setting: str) -> list[str]:
    """Per workload and backend (and the other setting) measured with `setting` ("cache" or
    "extend_graph") on and off: on / off in tokens/s."""
    other = "extend_graph" if setting == "cache" else "cache"
    by = {(r["workload"], r["backend"], r[other], r[setting]): r for r in rows}
    return [f"{w} {b} ({other} {o}): {setting} on / off = {by[(w, b, o, 'on')]['tok_s'] / r['tok_s']:.2f}x "
            f"(prefill tokens {by[(w, b, o, 'on')]['prefill_tokens']} / {r['prefill_tokens']})"
            for (w, b, o, c), r in by.items() if c == "off" and (w, b, o, "on") in by]


def quant_gains(rows: list[dict], base: str, base_kv: str = "auto") -> list[str]:
    """Per workload, backend, cache and extend-graph setting: each other (--quantization, --kv-cache-dtype)'s
    tokens/s over (base, base_kv)'s."""
    key = lambda r: (r["workload"], r["backend"], r["cache"], r["extend_graph"])  # noqa: E731
    kind = lambda r: (r["quantization"], r.get("kv_cache_dtype", "auto"))  # noqa: E731
    name = lambda q, kv: q if kv == "auto" else f"{q} + {kv} KV"  # noqa: E731
    first = {key(r): r for r in rows if kind(r) == (base, base_kv)}
    return [f"{r['workload']} {r['backend']}: {name(*kind(r))} / {name(base, base_kv)} = "
            f"{r['tok_s'] / first[key(r)]['tok_s']:.2f}x tok/s" for r in rows if kind(r) != (base, base_kv) and key(r) in first]


def main(argv: list[str] | None = None) -> list[dict]:
    ns = parse_args(argv)
    tb_s, rows = copy_tb_s(ns.device), []
    for backend in ns.backends:
        for cache in ns.cache:
            for extend_graph in ns.extend_graph:
                for quant in ns.quantization:
                    for kv in ns.kv_cache_dtype:
                        rows += run_engine(ns, backend, cache, tb_s, extend_graph, quant, kv)
                        payload = {"args": vars(ns), "copy_tb_s": tb_s, "rows": rows}
                        report.write_result("e2e", ns.model, payload, ns.out, ns.device)  # kept if a later engine fails
    print(report.table(sorted(rows, key=lambda r: r["workload"]), COLUMNS, f"{ns.model}, copy {tb_s:.2f} TB/s"))
    print("\n".join(gains(rows, "cache") + gains(rows, "extend_graph") + quant_gains(rows, ns.quantization[0], ns.kv_cache_dtype[0])))
    if ns.profile:
        print_profiles([r for r in rows if "profile" in r])
    return rows


if __name__ == "__main__":
    main()
