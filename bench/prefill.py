"""Prefill against its peer: the engine's time to first token beside the peer's compiled prefill
forward (bench/peer.py) of the same prompts, in one process; then time to first token with a cached prefix.

Engine: generate() of `bs` fresh prompts of `length` tokens with one output token (synchronised
wall time, median of --repeats, each on an emptied prefix cache). Peer: one compiled causal forward
of the same shape. Floor: the matmul FLOPs (2 x parameters x tokens, and the causal attention's) at
the measured bf16 matmul peak. Cached probe (per length): a request with a new prefix (uncached),
one sharing that prefix with a new suffix (cached), and the same again (all but its last token
cached: the per-call floor); medians of --repeats rounds, each on an emptied cache.

    python -m bench.prefill --models llama-3.2-1b llama-3.1-8b --backends triton flashinfer
"""

from __future__ import annotations

import argparse
import statistics

import torch

from backplane import Engine
from bench import peer, report, steps
from bench.timing import MATMUL_PEAK_FLOP_S, matmul_peak_flop_s
from bench.workload import model_sizes, prompts

COLUMNS = [("model", "model", ""), ("backend", "backend", ""), ("quant", "quantization", ""), ("bs", "batch_size", "d"), ("length", "length", "d"),
           ("peer ms", "peer_ms", ".2f"), ("engine ms", "engine_ms", ".2f"), ("engine/peer", "ratio", ".2f"),
           ("floor ms", "floor_ms", ".2f"), ("engine/floor", "of_floor", ".2f"), ("x first quant", "speedup", ".2f")]
PROBE_COLUMNS = [("model", "model", ""), ("backend", "backend", ""), ("prefix", "prefix", "d"), ("suffix", "suffix", "d"),
                 ("uncached ms", "uncached_ms", ".1f"), ("cached ms", "cached_ms", ".1f"), ("floor ms", "floor_ms", ".1f"),
                 ("cached/uncached", "ratio", ".2f"), ("above floor", "ratio_above_floor", ".2f")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = report.parser(__doc__)
    p.add_argument("--models", nargs="+", default=["llama-3.2-1b", "llama-3.1-8b"])
    p.add_argument("--backends", nargs="+", default=["triton", "flashinfer"])
    p.add_argument("--cases", nargs="+", default=["1x512", "1x2048", "4x2048", "8x1024"], metavar="BSxLENGTH")
    p.add_argument("--probe", type=int, nargs=2, default=(2048, 128), metavar=("PREFIX", "SUFFIX"),
                   help="the cached-prefix probe's lengths (0 0: no probe)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quantization", nargs="+", default=["none"], help="--quantization of each engine (none, fp8, ...)")
    p.add_argument("--no-compile", action="store_true", help="run the peer eagerly (CPU smoke runs)")
    ns = p.parse_args(argv)
    ns.cases = [tuple(int(n) for n in case.split("x")) for case in ns.cases]
    return ns


def ttft_ms(engine: Engine, batch: list[list[int]]) -> float:
    """Wall ms of generate() with one output token per prompt, the device synchronised."""
    return steps.timed_generate(engine, batch, steps.greedy(1))[0] * 1e3


def engine_prefill_ms(engine: Engine, bs: int, length: int, repeats: int) -> float:
    """Median time to first token of bs fresh prompts (new tokens each repeat, an emptied cache)."""
    vocab, times = int(engine.runner.hf_config.vocab_size), []
    for i in range(repeats + 1):  # the first warms this shape's kernels up and is dropped
        engine.flush_cache()
        times.append(ttft_ms(engine, prompts([length] * bs, vocab, seed=100 + i)))
    return statistics.median(times[1:])


def floor_ms(config, bs: int, length: int, linear_peak: float = MATMUL_PEAK_FLOP_S) -> float:
    """The prefill's linear FLOPs at linear_peak (FP8's for FP8 weights) and its causal attention's at
    MATMUL_PEAK_FLOP_S (bf16)."""
    _, params = model_sizes(config)
    from backplane.models.config_utils import head_dim_of

    attention = 4 * config.num_attention_heads * head_dim_of(config) * length * (length + 1) / 2 * config.num_hidden_layers
    return (2 * params * length / linear_peak + attention / MATMUL_PEAK_FLOP_S) * bs * 1e3


def cached_probe(engine: Engine, prefix: int, suffix: int, repeats: int) -> dict:
    """Median TTFT of an uncached prompt, a cached-prefix one and the same again (the floor), with
    the prompt tokens each found in the cache."""
    vocab, probes = int(engine.runner.hf_config.vocab_size), {"uncached": [], "cached": [], "floor": []}
    for i in range(repeats + 1):  # round 0 warms this length's kernels up and is dropped
        engine.flush_cache()
        head, tail, other_tail = prompts([prefix, suffix, suffix], vocab, seed=200 + i)
        # the uncached request leaves `head` in the cache for the cached one, whose repeat is the floor
        for name, prompt in (("uncached", head + tail), ("cached", head + other_tail), ("floor", head + other_tail)):
            hits = engine.stats()["prefix_cache"]["hit_tokens"]
            ms = ttft_ms(engine, [prompt])
            if i:
                probes[name].append({"ms": ms, "hit_tokens": engine.stats()["prefix_cache"]["hit_tokens"] - hits})
    unc, cac, flo = (statistics.median(p["ms"] for p in probes[k]) for k in ("uncached", "cached", "floor"))
    return {"prefix": prefix, "suffix": suffix, "uncached_ms": unc, "cached_ms": cac, "floor_ms": flo, "probes": probes,
            "ratio": cac / unc, "ratio_above_floor": (cac - flo) / (unc - flo) if unc > flo else None}


def engine_settings(ns: argparse.Namespace, model: str, backend: str, quantization: str = "none") -> dict:
    longest = max(bs * n for bs, n in ns.cases + [(1, sum(ns.probe))])
    return dict(model=model, device=ns.device, attention_backend=backend, max_running_requests=max(bs for bs, _ in ns.cases),
                max_total_tokens=2 * longest + 4096, chunked_prefill_size=max(8192, longest), quantization=quantization)


def measure_engine(ns: argparse.Namespace, engine: Engine) -> tuple[list[dict], dict | None]:
    """One engine's rows (one per case) and its cached-prefix probe (None with --probe 0 0)."""
    rows = [{"batch_size": bs, "length": n, "engine_ms": engine_prefill_ms(engine, bs, n, ns.repeats),
             "floor_ms": floor_ms(engine.runner.hf_config, bs, n, matmul_peak_flop_s(engine))} for bs, n in ns.cases]
    return rows, cached_probe(engine, *ns.probe, ns.repeats) if all(ns.probe) else None


def main(argv: list[str] | None = None) -> tuple[list[dict], list[dict]]:
    from backplane.models.presets import get_preset

    ns = parse_args(argv)
    all_rows, probes = [], []
    for model in ns.models:
        rows = []
        for backend in ns.backends:
            for quant in ns.quantization:
                backend_rows, probe = steps.with_engine(engine_settings(ns, model, backend, quant),
                                                        lambda e: measure_engine(ns, e))
                tags = {"model": model, "backend": backend, "quantization": quant}
                rows += [r | tags for r in backend_rows]
                probes += [probe | tags] if probe else []
        peers = {case: peer.prefill_ms(get_preset(model), *case, torch.device(ns.device), not ns.no_compile, ns.repeats)
                 for case in ns.cases}  # after the engines are gone: both never hold memory at once
        for row in rows:
            row["peer_ms"] = peers[(row["batch_size"], row["length"])]
        report.add_ratios(rows, {"ratio": ("engine_ms", "peer_ms"), "of_floor": ("engine_ms", "floor_ms")})
        first = {(r["backend"], r["batch_size"], r["length"]): r["engine_ms"] for r in rows
                 if r["quantization"] == ns.quantization[0]}
        for row in rows:  # throughput over the first --quantization's (same tokens): its time / this time
            row["speedup"] = first[(row["backend"], row["batch_size"], row["length"])] / row["engine_ms"]
        payload = {"args": vars(ns), "rows": rows, "cached_probe": [p for p in probes if p["model"] == model]}
        report.write_result("prefill", model, payload, ns.out, ns.device)
        all_rows += rows
    print(report.table(all_rows, COLUMNS))
    print(report.table(probes, PROBE_COLUMNS))
    return all_rows, probes


if __name__ == "__main__":
    main()
