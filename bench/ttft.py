"""Time to first token with extend graphs on and off, beside the peer's compiled prefill and extend
(bench/peer.py), per model and attention backend; and what capturing the extend graphs costs.

Engine: Engine.generate of one prompt with max_new_tokens=1, temperature 0 (synchronised wall time,
median of --repeats rounds after a dropped warm-up round; the two engines, extend graphs off and on,
built side by side and measured in interleaved rounds). Scenarios: a fresh prompt of N tokens
(--fresh), the same N-token prompt again (--repeat: all but its last token found in the radix
cache), a cached PREFIX and NEW tokens after it (--prefix), and one decode step at a context
(--decode-context, ms per step of the generate loop) for scale. Each sample records the prompt
tokens the engine computed (the radix cache's prefill_tokens), and a last pass which extend graphs
(requests x token bucket) replayed. Peer: one request's new tokens after the same cached prefix (0:
a fresh causal prefill) at the same lengths, each shape compiled once; its decode step is a loop of
one-token calls. Capture: each engine's build time (the first one built also pays the process's
one-time costs: compare capture_s), graph capture seconds, graph pool and device megabytes.
Profile (--profile SCENARIO...): after the timed rounds, one more request of each scenario on the
extend-graphs-on engine under torch.profiler (bench.steps.profile_request: host ops and Python
functions by self time, synchronisations, copies, kernels, device busy and idle time), in the JSON
row's "profile"; the profiler's overhead is in its times.

    python -m bench.ttft --models llama-3.2-1b llama-3.1-8b --backends triton flashinfer
    python -m bench.ttft --models llama-3.2-1b --backends triton --profile fresh-512 repeat-512
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
from dataclasses import dataclass

import torch

from backplane import Engine
from bench import peer, report, steps
from bench.prefill import ttft_ms
from bench.workload import prompts

VARIANTS = {"off": {"disable_extend_graph": True}, "on": {"disable_extend_graph": False}}  # built in this order
COLUMNS = [("model", "model", ""), ("backend", "backend", ""), ("scenario", "scenario", ""),
           ("computed", "computed", ""), ("on replays", "replayed", ""), ("off ms", "off_ms", ".2f"),
           ("on ms", "on_ms", ".2f"), ("on/off", "on_off", ".2f"), ("peer ms", "peer_ms", ".2f"),
           ("on/peer", "on_peer", ".2f"), ("off/peer", "off_peer", ".2f")]
CAPTURE_COLUMNS = [("model", "model", ""), ("backend", "backend", ""), ("extend graphs", "variant", ""),
                   ("startup s", "startup_s", ".1f"), ("capture s", "capture_s", ".1f"), ("graphs", "graphs", "d"),
                   ("graph MB", "graph_mb", ".0f"), ("device MB", "device_mb", ".0f")]
PROFILE_COLUMNS = COLUMNS[:3] + [("wall ms", "wall_ms", ".2f"), ("busy ms", "device_busy_ms", ".2f"),
                                 ("idle ms", "device_idle_ms", ".2f"), ("lead ms", "lead_ms", ".2f"),
                                 ("tail ms", "tail_ms", ".2f"), ("kernels", "kernels", ".0f"), ("syncs", "syncs", "d"),
                                 ("item()", "items", "d"), ("d2h", "d2h", "d"), ("h2d", "h2d", "d"),
                                 ("h2d pageable", "h2d_pageable", "d")]


@dataclass(frozen=True)
class Scenario:
    """One request of `new` tokens after `prefix` cached ones; kind "fresh", "repeat" (the same prompt
    twice: prefix + 1 tokens, `new` 1), "prefix" or "decode" (a decode step at context `prefix`, new 0)."""

    kind: str
    prefix: int
    new: int

    @property
    def name(self) -> str:
        return {"fresh": f"fresh-{self.new}", "repeat": f"repeat-{self.prefix + 1}", "decode": f"decode@{self.prefix}",
                "prefix": f"prefix-{self.prefix}+{self.new}"}[self.kind]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = report.parser(__doc__)
    p.add_argument("--models", nargs="+", default=["llama-3.2-1b", "llama-3.1-8b"])
    p.add_argument("--backends", nargs="+", default=["triton", "flashinfer"])
    p.add_argument("--fresh", type=int, nargs="*", default=[128, 512], metavar="N", help="fresh prompts of N tokens")
    p.add_argument("--repeat", type=int, nargs="*", default=[512], metavar="N", help="an N-token prompt sent again")
    p.add_argument("--prefix", type=int, nargs=2, default=(2048, 16), metavar=("PREFIX", "NEW"),
                   help="NEW tokens after a cached PREFIX (0 0: none)")
    p.add_argument("--decode-context", type=int, default=512, help="a decode step at this context (0: none)")
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=7, help="timed rounds (medians) after one warm-up round")
    p.add_argument("--cuda-graph-bs", type=int, nargs="+", default=[1], help="the decode graphs' batch sizes")
    p.add_argument("--cuda-graph-max-tokens", type=int, default=None, help="default: the engine's")
    p.add_argument("--cuda-graph-max-extend-bs", type=int, default=None, help="default: the engine's")
    p.add_argument("--peer-mode", choices=peer.COMPILE_MODES, default="reduce-overhead",
                   help="the peer's torch.compile mode (max-autotune-no-cudagraphs: plus a CUDA graph per shape)")
    p.add_argument("--no-compile", action="store_true", help="run the peer eagerly (CPU smoke runs)")
    p.add_argument("--profile", nargs="*", default=[], metavar="SCENARIO",
                   help="one more request of these scenarios (e.g. repeat-512) under the profiler, extend graphs on")
    ns = p.parse_args(argv)
    ns.scenarios = scenarios(ns)
    names = [sc.name for sc in ns.scenarios if sc.kind != "decode"]
    if any(name not in names for name in ns.profile):
        p.error(f"--profile: expected scenario names among {names}, got {ns.profile}")
    return ns


def scenarios(ns: argparse.Namespace) -> list[Scenario]:
    out = [Scenario("fresh", 0, n) for n in ns.fresh] + [Scenario("repeat", n - 1, 1) for n in ns.repeat]
    out += [Scenario("prefix", *ns.prefix)] if all(ns.prefix) else []
    return out + ([Scenario("decode", ns.decode_context, 0)] if ns.decode_context else [])


def engine_settings(ns: argparse.Namespace, model: str, backend: str, variant: str) -> dict:
    longest = max(s.prefix + max(s.new, ns.decode_steps + 8) for s in ns.scenarios)
    graphs = {k: v for k, v in (("cuda_graph_max_tokens", ns.cuda_graph_max_tokens),
                                ("cuda_graph_max_extend_bs", ns.cuda_graph_max_extend_bs)) if v is not None}
    return dict(model=model, device=ns.device, attention_backend=backend, max_running_requests=16,
                max_total_tokens=2 * longest + 4096, cuda_graph_bs=ns.cuda_graph_bs, **graphs, **VARIANTS[variant])


def sample(engine: Engine, sc: Scenario, ns: argparse.Namespace, seed: int, spy: bool = False) -> dict:
    """One timed request of scenario `sc` on an emptied cache (its prefix cached first, untimed):
    {"ms", "computed": prompt tokens computed, and with `spy` "replayed": the extend graphs it replayed}."""
    if sc.kind == "decode":
        return {"ms": steps.engine_step_ms(engine, 1, sc.prefix, ns.decode_steps), "computed": None}
    setup, prompt = request_prompts(engine, sc, seed)
    reset(engine, setup)
    before, keys = engine.stats()["prefix_cache"]["prefill_tokens"], []
    with replay_spy(engine, keys) if spy else contextlib.nullcontext():
        ms = ttft_ms(engine, [prompt])
    out = {"ms": ms, "computed": engine.stats()["prefix_cache"]["prefill_tokens"] - before}
    return out | ({"replayed": " ".join(keys) or "eager"} if spy else {})


def request_prompts(engine: Engine, sc: Scenario, seed: int) -> tuple[list[int] | None, list[int]]:
    """(the prompt that caches the scenario's prefix or None, the request's prompt) of a scenario but decode."""
    vocab = int(engine.runner.hf_config.vocab_size)
    head, tail, other = prompts([sc.prefix, max(sc.new, 1), max(sc.new, 1)], vocab, seed=seed)
    return {"fresh": (None, tail), "repeat": (head + tail, head + tail), "prefix": (head + tail, head + other)}[sc.kind]


def reset(engine: Engine, setup: list[int] | None) -> None:
    """An emptied cache holding `setup` (untimed) when given."""
    engine.flush_cache()
    if setup:
        steps.timed_generate(engine, [setup], steps.greedy(1))


def profile(engine: Engine, sc: Scenario) -> dict:
    """One request of scenario `sc` (not decode) under the profiler: steps.profile_request."""
    setup, prompt = request_prompts(engine, sc, seed=998)
    request = functools.partial(engine.generate, input_ids=[prompt], sampling_params=steps.greedy(1))
    split = steps.profile_request(request, engine.runner.device, lambda: reset(engine, setup))
    print(f"profiled {sc.name}: wall {split['wall_ms']:.2f} ms, device busy {split['device_busy_ms']:.2f} ms, "
          f"{split['syncs']} syncs", flush=True)
    return split


@contextlib.contextmanager
def replay_spy(engine: Engine, keys: list[str]):
    """Within the block, every graph the engine replays is noted in `keys`: an extend graph as
    "REQUESTSxTOKENS", another as "MODE@REQUESTS" (a cached prompt's one new token replays decode@1)."""
    graphs = engine.runner.graph_runner
    if graphs is None:
        yield
        return
    replay = type(graphs).replay

    def spy(batch, key=None):
        key = key or graphs.key_for(batch)
        keys.append(f"{key.batch_size}x{key.token_bucket}" if key.ragged else f"{key.mode.value}@{key.batch_size}")
        return replay(graphs, batch, key)

    graphs.replay = spy  # NOTE: an instance attribute shadows the method until the block ends
    try:
        yield
    finally:
        del graphs.replay


def measure_engines(ns: argparse.Namespace, engines: dict[str, Engine]) -> tuple[list[dict], dict]:
    """One row per scenario (each variant's median, runs and computed tokens), in interleaved rounds
    (round 0 warms up and is dropped), and each variant's capture."""
    samples = {(v, sc): [] for v in engines for sc in ns.scenarios}
    for i in range(ns.repeats + 1):
        for sc in ns.scenarios:
            for v, engine in engines.items():
                samples[(v, sc)].append(sample(engine, sc, ns, seed=1000 + i))
    rows = []
    for sc in ns.scenarios:
        row = {"scenario": sc.name, "kind": sc.kind, "prefix": sc.prefix, "new": sc.new}
        for v in engines:
            runs = samples[(v, sc)][1:]
            row |= {f"{v}_ms": statistics.median(r["ms"] for r in runs), f"{v}_runs_ms": [r["ms"] for r in runs],
                    f"{v}_computed": [r["computed"] for r in runs]}
        computed = {c for v in engines for c in row[f"{v}_computed"] if c is not None}
        row["computed"] = " ".join(str(c) for c in sorted(computed)) or None
        if sc.kind != "decode" and "on" in engines:
            row["replayed"] = sample(engines["on"], sc, ns, seed=999, spy=True)["replayed"]
        if sc.name in ns.profile and "on" in engines:
            row["profile"] = profile(engines["on"], sc)
        rows.append(row)
    return rows, {v: steps.graph_capture(e) for v, e in engines.items()}


def measure_backend(ns: argparse.Namespace, model: str, backend: str) -> tuple[list[dict], list[dict]]:
    """(scenario rows, capture rows) of one model and backend: its two engines side by side."""
    settings = {v: engine_settings(ns, model, backend, v) for v in VARIANTS}
    startup: dict[str, float] = {}
    rows, captures = steps.with_engines(settings, lambda engines: measure_engines(ns, engines), startup)
    tag = {"model": model, "backend": backend}
    print(f"{model} {backend}: " + ", ".join(f"extend graphs {v}: built in {startup[v]:.1f} s, capture "
                                            f"{c['capture_s'] or 0:.1f} s" for v, c in captures.items()), flush=True)
    return ([r | tag for r in rows],
            [tag | {"variant": v, "startup_s": startup[v]} | c for v, c in captures.items()])


def peer_figures(ns: argparse.Namespace, model: str) -> dict[str, float]:
    """{scenario: the peer's ms} of one model (its decode step: ms per step of a loop)."""
    from backplane.models.presets import get_preset

    cases = sorted({(sc.prefix, max(sc.new, 1)) for sc in ns.scenarios})
    times = peer.extend_ms(get_preset(model), cases, torch.device(ns.device), not ns.no_compile, ns.repeats,
                           ns.peer_mode, ns.decode_steps)
    figures = {sc.name: times[(sc.prefix, sc.new)] for sc in ns.scenarios}
    print(f"peer {model}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in figures.items()), flush=True)
    return figures


def ratios(rows: list[dict]) -> list[dict]:
    return report.add_ratios(rows, {"on_off": ("on_ms", "off_ms"), "on_peer": ("on_ms", "peer_ms"),
                                    "off_peer": ("off_ms", "peer_ms")})


def summary(rows: list[dict]) -> list[dict]:
    """Per model and backend: ours / peer on each fresh prompt, and the repeated prompt's one computed
    token / a decode step, with extend graphs off and on."""
    out = []
    for model, backend in dict.fromkeys((r["model"], r["backend"]) for r in rows):
        mine = [r for r in rows if (r["model"], r["backend"]) == (model, backend)]
        repeat = next((r for r in mine if r["kind"] == "repeat"), {})
        decode = next((r for r in mine if r["kind"] == "decode"), {})
        line = {"model": model, "backend": backend}
        for v in VARIANTS:
            line |= {f"{v}/peer {r['scenario']}": r.get(f"{v}_peer") for r in mine if r["kind"] == "fresh"}
            line[f"{v} cached/decode"] = report.ratio(repeat.get(f"{v}_ms"), decode.get(f"{v}_ms"))
        out.append(line)
    return out


def measure_model(ns: argparse.Namespace, model: str) -> tuple[list[dict], list[dict]]:
    """Every backend's rows and captures of one model beside the peer's figures (measured after the
    first backend, once its engines are gone: a run cut short still has them); written after each backend."""
    rows, captures, figures = [], [], None
    for backend in ns.backends:
        backend_rows, backend_captures = measure_backend(ns, model, backend)
        rows, captures = rows + backend_rows, captures + backend_captures
        figures = figures or peer_figures(ns, model)
        for row in rows:
            row["peer_ms"] = figures[row["scenario"]]
        ratios(rows)
        payload = {"args": {k: v for k, v in vars(ns).items() if k != "scenarios"}, "rows": rows,
                   "captures": captures, "peer": figures, "summary": summary(rows)}
        report.write_result("ttft", model, payload, ns.out, ns.device)
    return rows, captures


def print_profiles(rows: list[dict]) -> None:
    """The profiled requests' table, then each one's top host ops, Python functions and idle gaps."""
    if not rows:
        return
    print(report.table([r | r["profile"] for r in rows], PROFILE_COLUMNS,
                       "one request under the profiler, extend graphs on (profiler overhead included; the JSON row's profile)"))
    for r in rows:
        for key in ("top_ops", "top_python", "top_gaps"):
            tops = ", ".join(f"{name} {ms:.3f} ms x{n:g}" for name, ms, n in r["profile"][key][:5])
            print(f"  {r['model']} {r['backend']} {r['scenario']} {key}: {tops or '-'}")


def main(argv: list[str] | None = None) -> dict:
    ns = parse_args(argv)
    rows, captures = [], []
    for model in ns.models:
        model_rows, model_captures = measure_model(ns, model)
        rows, captures = rows + model_rows, captures + model_captures
    print(report.table(captures, CAPTURE_COLUMNS, "engine startup and graph capture, extend graphs off / on"))
    print_profiles([r for r in rows if r.get("profile")])
    for line in summary(rows):
        print("  ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in line.items()))
    print(report.table(rows, COLUMNS, "time to first token (ms), extend graphs off / on, beside the peer"))
    return {"rows": rows, "captures": captures, "summary": summary(rows)}


if __name__ == "__main__":
    main()
