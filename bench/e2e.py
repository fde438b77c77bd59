"""End-to-end offline throughput against the floor: Engine.generate over whole workloads, graphs up to
the running batch, per attention backend and radix-cache setting.

Workloads of --requests requests: "fixed" (1024 input / 256 output tokens), "sharegpt-like" (seeded
log-normal lengths), "shared-prefix" (--groups groups sharing a prefix, each request its own suffix,
shuffled; --prefix-shape) and "distinct" (as many prompts of the same length, nothing shared). Each
is timed --repeats times on an emptied prefix cache and a fresh slot order; the median run is kept.
Reported: output tokens/s, median TPOT and TTFT, the prompt tokens prefill computed, the floor (every
decode step reads the weights once and the running requests' KV at the card's copy bandwidth, the
prefill does its matmul FLOPs at the bf16 matmul peak; all requests in one batch) and the share of it.

    python -m bench.e2e --model llama-3.2-1b --backends triton flashinfer --repeats 3
    python -m bench.e2e --workloads shared-prefix distinct --cache on off           # the radix cache's gain
    python -m bench.e2e --workloads sharegpt-like --extend-graph on off             # extend graphs' gain
"""

from __future__ import annotations

import argparse
import statistics

from backplane import Engine, SamplingParams
from bench import report, steps
from bench.timing import MATMUL_PEAK_FLOP_S, copy_tb_s
from bench.workload import model_sizes, prompts, shapes, shared_prefix, weight_bytes

COLUMNS = [("workload", "workload", ""), ("backend", "backend", ""), ("quant", "quantization", ""), ("cache", "cache", ""),
           ("extend graph", "extend_graph", ""), ("tok/s", "tok_s", ".0f"),
           ("TPOT ms", "tpot_ms", ".2f"), ("TTFT ms", "ttft_ms", ".0f"), ("prefill tokens", "prefill_tokens", "d"),
           ("floor tok/s", "floor_tok_s", ".0f"), ("of floor", "of_floor", ".0%"), ("runs s", "runs", "")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = report.parser(__doc__)
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--backends", nargs="+", default=["triton", "flashinfer"])
    p.add_argument("--cache", nargs="+", choices=["on", "off"], default=["on"], help="radix cache settings, each an engine")
    p.add_argument("--extend-graph", nargs="+", choices=["on", "off"], default=["on"],
                   help="extend (prefill) CUDA graphs on or off (--disable-extend-graph), each an engine")
    p.add_argument("--quantization", nargs="+", default=["none"], help="--quantization of each engine (none, fp8, ...)")
    p.add_argument("--workloads", nargs="+", default=["fixed", "sharegpt-like"],
                   choices=["fixed", "sharegpt-like", "shared-prefix", "distinct"])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--max-running", type=int, default=256)
    p.add_argument("--fixed-shape", type=int, nargs=2, default=(1024, 256), metavar=("INPUT", "OUTPUT"))
    p.add_argument("--groups", type=int, default=8, help="shared-prefix: groups sharing one prefix")
    p.add_argument("--prefix-shape", type=int, nargs=3, default=(2048, 128, 128), metavar=("PREFIX", "SUFFIX", "OUTPUT"))
    p.add_argument("--repeats", type=int, default=1, help="timed runs per workload (the median is kept)")
    return p.parse_args(argv)


def workload(ns: argparse.Namespace, kind: str, vocab: int) -> tuple[list[list[int]], list[int]]:
    """(prompts, output lengths) of one workload."""
    prefix, suffix, out = ns.prefix_shape
    if kind == "shared-prefix":
        return shared_prefix(ns.groups, ns.requests // ns.groups, prefix, suffix, vocab), [out] * ns.requests
    if kind == "distinct":
        return prompts([prefix + suffix] * ns.requests, vocab, seed=7), [out] * ns.requests
    lengths = shapes(kind, ns.requests, tuple(ns.fixed_shape))
    return prompts([n for n, _ in lengths], vocab), [n for _, n in lengths]


def floor_seconds(lengths: list[tuple[int, int]], weights: int, kv_per_token: int, matmul_params: int, tb_s: float) -> float:
    """Decode: one weight read per step plus the running requests' KV at tb_s; prefill: 2 x params x tokens FLOPs."""
    decode_bytes = 0
    for step in range(max(n_out for _, n_out in lengths) - 1):  # the first token comes from the prefill
        running = [n_in for n_in, n_out in lengths if n_out - 1 > step]
        decode_bytes += weights + kv_per_token * sum(n_in + 1 + step for n_in in running)
    prefill_flops = 2.0 * matmul_params * sum(n_in for n_in, _ in lengths)
    return decode_bytes / (tb_s * 1e12) + prefill_flops / MATMUL_PEAK_FLOP_S


def timed_run(engine: Engine, batch: list[list[int]], params: list[SamplingParams]) -> tuple[float, list, int]:
    """(seconds, outputs, prompt tokens prefill computed) of one generate on an emptied cache and a fresh slot order."""
    engine.flush_cache()
    before = engine.stats()["prefix_cache"]["prefill_tokens"]
    seconds, outs = steps.timed_generate(engine, batch, params)
    return seconds, outs, engine.stats()["prefix_cache"]["prefill_tokens"] - before


def run_workload(ns: argparse.Namespace, engine: Engine, kind: str, tb_s: float) -> dict:
    """One workload on one engine: warm-up (its first requests twice, the second time from the cache),
    then --repeats timed runs; the median run's figures."""
    batch, out_lens = workload(ns, kind, int(engine.runner.hf_config.vocab_size))
    params = [steps.greedy(n) for n in out_lens]
    for _ in range(2):
        engine.generate(input_ids=batch[:4], sampling_params=params[:4])
    runs = sorted((timed_run(engine, batch, params) for _ in range(ns.repeats)), key=lambda r: r[0])
    seconds, outs, prefilled = runs[(len(runs) - 1) // 2]
    tokens = sum(len(o.token_ids) for o in outs)
    runner = engine.runner
    kv_per_token, matmul_params = model_sizes(runner.hf_config, runner.token_to_kv_pool.k_buffers[0].element_size())
    floor = floor_seconds([(len(p), n) for p, n in zip(batch, out_lens)], weight_bytes(runner.model), kv_per_token,
                          matmul_params, tb_s)
    graphs = runner.graph_runner
    return {"workload": kind, "requests": len(batch), "input_tokens": sum(map(len, batch)), "output_tokens": tokens,
            "seconds": seconds, "runs": " ".join(f"{r[0]:.2f}" for r in runs), "tok_s": tokens / seconds,
            "tpot_ms": statistics.median(o.tpot_s for o in outs if o.tpot_s is not None) * 1e3,
            "ttft_ms": statistics.median(o.ttft_s for o in outs) * 1e3, "prefill_tokens": prefilled,
            "floor_s": floor, "floor_tok_s": tokens / floor, "of_floor": floor / seconds,
            "graphs_cover_batch": graphs is not None and max(graphs.sizes) >= min(len(batch), ns.max_running)}


def run_engine(ns: argparse.Namespace, backend: str, cache: str, tb_s: float, extend_graph: str = "on",
               quantization: str = "none") -> list[dict]:
    # Graphs up to the running batch: past --cuda-graph-max-bs (160 by default) a decode step runs
    # eagerly, which on a small model costs several times the replayed step.
    settings = dict(model=ns.model, device=ns.device, attention_backend=backend, max_running_requests=ns.max_running,
                    cuda_graph_max_bs=ns.max_running, disable_radix_cache=cache == "off",
                    disable_extend_graph=extend_graph == "off", quantization=quantization)
    rows = steps.with_engine(settings, lambda engine: [run_workload(ns, engine, kind, tb_s) for kind in ns.workloads])
    return [r | {"backend": backend, "cache": cache, "extend_graph": extend_graph, "quantization": quantization}
            for r in rows]


def gains(rows: list[dict], setting: str) -> list[str]:
    """Per workload and backend (and the other setting) measured with `setting` ("cache" or
    "extend_graph") on and off: on / off in tokens/s."""
    other = "extend_graph" if setting == "cache" else "cache"
    by = {(r["workload"], r["backend"], r[other], r[setting]): r for r in rows}
    return [f"{w} {b} ({other} {o}): {setting} on / off = {by[(w, b, o, 'on')]['tok_s'] / r['tok_s']:.2f}x "
            f"(prefill tokens {by[(w, b, o, 'on')]['prefill_tokens']} / {r['prefill_tokens']})"
            for (w, b, o, c), r in by.items() if c == "off" and (w, b, o, "on") in by]


def quant_gains(rows: list[dict], base: str) -> list[str]:
    """Per workload, backend, cache and extend-graph setting: each other --quantization's tokens/s over `base`'s."""
    key = lambda r: (r["workload"], r["backend"], r["cache"], r["extend_graph"])  # noqa: E731
    first = {key(r): r for r in rows if r["quantization"] == base}
    return [f"{r['workload']} {r['backend']}: {r['quantization']} / {base} = {r['tok_s'] / first[key(r)]['tok_s']:.2f}x tok/s"
            for r in rows if r["quantization"] != base and key(r) in first]


def main(argv: list[str] | None = None) -> list[dict]:
    ns = parse_args(argv)
    tb_s, rows = copy_tb_s(ns.device), []
    for backend in ns.backends:
        for cache in ns.cache:
            for extend_graph in ns.extend_graph:
                for quant in ns.quantization:
                    rows += run_engine(ns, backend, cache, tb_s, extend_graph, quant)
                    payload = {"args": vars(ns), "copy_tb_s": tb_s, "rows": rows}
                    report.write_result("e2e", ns.model, payload, ns.out, ns.device)  # kept if a later engine fails
    print(report.table(sorted(rows, key=lambda r: r["workload"]), COLUMNS, f"{ns.model}, copy {tb_s:.2f} TB/s"))
    print("\n".join(gains(rows, "cache") + gains(rows, "extend_graph") + quant_gains(rows, ns.quantization[0])))
    return rows


if __name__ == "__main__":
    main()
