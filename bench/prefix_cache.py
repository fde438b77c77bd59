"""Prefix caching (the radix cache) on one GPU, dummy weights, with and without the cache in one process.

Per model (default llama-3.2-1b and llama-3.1-8b):
1. shared: --num-groups groups of --per-group requests (default 8 x 32 = 256); a group shares a
   --prefix-len token prefix (2048), each request adds a --suffix-len unique suffix (128) and
   generates --output-len tokens (128, ignore_eos); requests shuffled, all submitted at once.
2. nothing shared: as many requests of the same total prompt length, all distinct.
   Each workload runs --repeats times with the cache off and on, alternating (off on on off ...),
   on the same engine (the cache is swapped, graphs and pools stay; the pool's free list is put
   back in a fresh pool's order before each run); the medians are compared.
   Every run reports the tokens its prefills computed (the ideal with the cache: groups x prefix +
   requests x suffix) and its decode steps, and how many of those ran without a CUDA graph.
3. TTFT probe, on an idle engine, cache on, --probes rounds of distinct prompts of the same length,
   each round on an emptied cache: an uncached prompt (new prefix), a cached one (that prefix,
   another suffix), and the same cached prompt again, which computes only its last token: the
   per-call floor (host work, one forward over the cached context). Reported: the medians, cached/uncached, the same ratio above the
   floor, and the cache hits of each probe (so a probe that missed the cache shows).
JSON to --out (default $OUT/prefix_cache.json); a short table last.

    python bench/prefix_cache.py                       # the GPU run (both models)
    python bench/prefix_cache.py --models tiny-llama --device cpu --dtype float32 --backend torch_native \
        --num-groups 2 --per-group 3 --prefix-len 64 --suffix-len 8 --output-len 4 --probes 1 --repeats 1  # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch

from backplane import Engine, ForwardMode, SamplingParams
from backplane.engine.prefix_cache import PrefixCache


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["llama-3.2-1b", "llama-3.1-8b"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--backend", default="auto", help="--attention-backend")
    p.add_argument("--num-groups", type=int, default=8)
    p.add_argument("--per-group", type=int, default=32)
    p.add_argument("--prefix-len", type=int, default=2048)
    p.add_argument("--suffix-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="runs per workload and cache setting (medians)")
    p.add_argument("--probes", type=int, default=5)
    p.add_argument("--cuda-graph-max-bs", type=int, default=256,
                   help="graphs up to this batch size, so that decoding the 256 requests replays one "
                        "(the engine's default stops at 160)")
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def workloads(ns: argparse.Namespace, vocab: int, seed: int = 0) -> dict[str, list[list[int]]]:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    prefixes = [tokens(ns.prefix_len) for _ in range(ns.num_groups)]
    shared = [p + tokens(ns.suffix_len) for p in prefixes for _ in range(ns.per_group)]
    rng.shuffle(shared)
    distinct = [tokens(ns.prefix_len + ns.suffix_len) for _ in shared]
    return {"shared": shared, "nothing_shared": distinct}


def ideal_prefill_tokens(ns: argparse.Namespace) -> dict[str, dict[str, int]]:
    """Tokens the prefills must compute with the cache (on) and without it (off), per workload."""
    n = ns.num_groups * ns.per_group
    full = n * (ns.prefix_len + ns.suffix_len)
    return {"shared": {"on": ns.num_groups * ns.prefix_len + n * ns.suffix_len, "off": full},
            "nothing_shared": {"on": full, "off": full}}


def set_cache(engine: Engine, enabled: bool) -> None:
    """Empty the cache and turn it on or off (between runs, when no request is running). The free
    list is sorted again, so every run starts from a fresh pool's slot order, not the previous run's."""
    engine.scheduler.prefix_cache.clear()
    runner = engine.runner
    runner.token_to_kv_pool.sort_free()
    engine.scheduler.prefix_cache = PrefixCache(runner.token_to_kv_pool, runner.req_to_token_pool, enabled=enabled)


def sync(engine: Engine) -> None:
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()


class ForwardCounter:
    """Wraps the runner's forward: prefill tokens, decode steps, and decode steps run eagerly."""

    def __init__(self, engine: Engine):
        self.runner, self.forward = engine.runner, engine.runner.forward
        self.reset()
        engine.runner.forward = self

    def reset(self) -> None:
        self.counts = {"prefill_tokens": 0, "decode_steps": 0, "decode_steps_eager": 0}

    def __call__(self, batch):
        if batch.forward_mode == ForwardMode.EXTEND:
            self.counts["prefill_tokens"] += batch.num_tokens
        elif batch.forward_mode.is_decode:
            self.counts["decode_steps"] += 1
            graphs = self.runner.graph_runner
            self.counts["decode_steps_eager"] += not (graphs is not None and graphs.can_run(batch))
        return self.forward(batch)


def run(engine: Engine, counter: ForwardCounter, prompts: list[list[int]], output_len: int, enabled: bool) -> dict:
    """One generate call over `prompts` with the cache on or off: timing, counts, outputs."""
    set_cache(engine, enabled)
    counter.reset()
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    sync(engine)
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    sync(engine)
    elapsed = time.perf_counter() - start
    assert all(o.error is None for o in outs), next(o.error for o in outs if o.error)
    num_out = sum(len(o.token_ids) for o in outs)
    ttfts = sorted(o.ttft_s for o in outs)
    return {"cache": enabled, "requests": len(prompts), "elapsed_s": elapsed, "output_tokens_per_s": num_out / elapsed,
            "total_tokens_per_s": (num_out + sum(map(len, prompts))) / elapsed,
            "ttft_median_s": statistics.median(ttfts), "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
            "ttft_max_s": ttfts[-1], **counter.counts,
            "prefix_cache": engine.stats()["prefix_cache"], "outputs": [o.token_ids for o in outs]}


def compare(engine: Engine, counter: ForwardCounter, prompts: list[list[int]], ns: argparse.Namespace) -> dict:
    """--repeats runs with the cache off and on, alternating (off on, on off, ...): the median of each."""
    runs = {False: [], True: []}
    for i in range(ns.repeats):
        for enabled in ((False, True) if i % 2 == 0 else (True, False)):
            runs[enabled].append(run(engine, counter, prompts, ns.output_len, enabled))
    same = sum(a == b for a, b in zip(runs[False][0]["outputs"], runs[True][0]["outputs"]))
    for r in runs[False] + runs[True]:
        del r["outputs"]
    off, on = (statistics.median(r["output_tokens_per_s"] for r in runs[k]) for k in (False, True))
    return {"off": runs[False][0], "on": runs[True][0], "runs_off": runs[False], "runs_on": runs[True],
            "off_tokens_per_s_median": off, "on_tokens_per_s_median": on, "speedup": on / off,
            "greedy_equal": same, "requests": len(prompts)}


def timed_request(engine: Engine, prompt: list[int]) -> dict:
    """One request with one output token on the idle engine: its TTFT, the call's time, cache hits."""
    one = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    hits = engine.stats()["prefix_cache"]["hit_tokens"]
    sync(engine)
    start = time.perf_counter()
    out = engine.generate(input_ids=[prompt], sampling_params=one)[0]
    sync(engine)
    return {"ttft_s": out.ttft_s, "call_s": time.perf_counter() - start,
            "hit_tokens": engine.stats()["prefix_cache"]["hit_tokens"] - hits}


def ttft_probe(engine: Engine, ns: argparse.Namespace, vocab: int) -> dict:
    """Median TTFT of uncached, cached and fully cached (floor) prompts of one length (see module doc)."""
    rng = random.Random(1)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    probes = {"uncached": [], "cached": [], "floor": []}
    for i in range(ns.probes + 1):  # round 0 warms this length's kernels up and is dropped
        set_cache(engine, True)  # empty: the first probe of the round finds nothing cached
        prefix = tokens(ns.prefix_len)
        cached = prefix + tokens(ns.suffix_len)
        for name, prompt in (("uncached", prefix + tokens(ns.suffix_len)), ("cached", cached), ("floor", cached)):
            result = timed_request(engine, prompt)
            if i:
                probes[name].append(result)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in ("ttft_s", "call_s", "hit_tokens")}
           for name, rs in probes.items()}
    unc, cac, flo = (med[k]["ttft_s"] for k in ("uncached", "cached", "floor"))
    return {**{f"{k}_ttft_s": med[k]["ttft_s"] for k in med}, "medians": med, "probes": probes,
            "ratio": cac / unc, "ratio_above_floor": (cac - flo) / (unc - flo) if unc > flo else None}


def bench_model(model: str, ns: argparse.Namespace) -> dict:
    settings = dict(load_format="dummy", device=ns.device, dtype=ns.dtype, attention_backend=ns.backend)
    if ns.device != "cpu":
        settings["cuda_graph_max_bs"] = ns.cuda_graph_max_bs
    if ns.max_total_tokens:
        settings["max_total_tokens"] = ns.max_total_tokens
    if ns.max_running_requests:
        settings["max_running_requests"] = ns.max_running_requests
    engine = Engine(model, **settings)
    counter = ForwardCounter(engine)
    vocab = int(engine.runner.hf_config.vocab_size)
    loads = workloads(ns, vocab)
    run(engine, counter, loads["shared"][: min(8, len(loads["shared"]))], 4, True)  # warm-up (kernels, allocator)
    result = {"model": model, "backends": {k: engine.backends[k] for k in ("device", "dtype")},
              "ideal_prefill_tokens": ideal_prefill_tokens(ns)}
    for name, prompts in loads.items():
        result[name] = compare(engine, counter, prompts, ns)
    result["nothing_shared"]["loss"] = 1 - result["nothing_shared"]["speedup"]
    result["ttft"] = ttft_probe(engine, ns, vocab)
    engine.shutdown()
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def table(results: list[dict]) -> str:
    lines = [f"{'model':<14} {'shared tok/s off':>16} {'on':>9} {'ratio':>6} {'prefill tok on/ideal/off':>26} "
             f"{'eager decode':>12} {'no-share loss':>13} {'greedy equal':>13}"]
    for r in results:
        s, n = r["shared"], r["nothing_shared"]
        ideal, eager = r["ideal_prefill_tokens"]["shared"], s["on"]["decode_steps_eager"]
        prefill = f"{s['on']['prefill_tokens']}/{ideal['on']}/{s['off']['prefill_tokens']}"
        lines.append(f"{r['model']:<14} {s['off_tokens_per_s_median']:>16.1f} {s['on_tokens_per_s_median']:>9.1f} "
                     f"{s['speedup']:>5.2f}x {prefill:>26} {eager:>5}/{s['on']['decode_steps']:<6} "
                     f"{100 * n['loss']:>12.1f}% {s['greedy_equal'] + n['greedy_equal']:>6}/{s['requests'] + n['requests']}")
    lines.append(f"{'model':<14} {'TTFT uncached':>14} {'cached':>9} {'floor':>9} {'ratio':>6} {'above floor':>12} "
                 f"{'hits cached/uncached':>21}")
    for r in results:
        t = r["ttft"]
        m = t["medians"]
        above = t["ratio_above_floor"]
        lines.append(f"{r['model']:<14} {1000 * t['uncached_ttft_s']:>11.1f} ms {1000 * t['cached_ttft_s']:>6.1f} ms "
                     f"{1000 * t['floor_ttft_s']:>6.1f} ms {t['ratio']:>6.2f} {above if above is None else f'{above:.2f}':>12} "
                     f"{m['cached']['hit_tokens']:>12.0f}/{m['uncached']['hit_tokens']:.0f}")
    return "\n".join(lines)


def main() -> None:
    ns = parse_args()
    results = [bench_model(model, ns) for model in ns.models]
    out = Path(ns.out or Path(os.environ.get("OUT", ".")) / "prefix_cache.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(ns), "results": results}, indent=1))
    print(f"wrote {out}")
    print(table(results))


if __name__ == "__main__":
    main()
