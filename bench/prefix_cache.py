"""Prefix caching (the radix cache) on one GPU, dummy weights, with and without the cache in one process.

Per model (default llama-3.2-1b and llama-3.1-8b):
1. shared: --num-groups groups of --per-group requests (default 8 x 32 = 256); a group shares a
   --prefix-len token prefix (2048), each request adds a --suffix-len unique suffix (128) and
   generates --output-len tokens (128, ignore_eos); requests shuffled, all submitted at once.
2. nothing shared: as many requests of the same total prompt length, all distinct.
3. TTFT probe: on an idle engine, one request with a new prefix (uncached) and then one sharing
   that prefix with another suffix (cached), one output token each; the median of --probes pairs.
Each workload runs with the cache on and off on the same engine (the cache is swapped, graphs and
pools stay). Reports the throughput ratio on the shared workload, the cached/uncached TTFT ratio and
the throughput loss with the cache on when nothing is shared. JSON to --out (default
$OUT/prefix_cache.json); a short table last.

    python bench/prefix_cache.py                       # the GPU run (both models)
    python bench/prefix_cache.py --models tiny-llama --device cpu --dtype float32 --backend torch_native \
        --num-groups 2 --per-group 3 --prefix-len 64 --suffix-len 8 --output-len 4 --probes 1   # smoke run
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

from backplane import Engine, SamplingParams
from backplane.engine.prefix_cache import PrefixCache


def parse_args() -> argparse.Namespace:
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
    p.add_argument("--probes", type=int, default=5)
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--out", default=None)
    return p.parse_args()


def workloads(ns: argparse.Namespace, vocab: int, seed: int = 0) -> dict[str, list[list[int]]]:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    prefixes = [tokens(ns.prefix_len) for _ in range(ns.num_groups)]
    shared = [p + tokens(ns.suffix_len) for p in prefixes for _ in range(ns.per_group)]
    rng.shuffle(shared)
    distinct = [tokens(ns.prefix_len + ns.suffix_len) for _ in shared]
    return {"shared": shared, "nothing_shared": distinct}


def set_cache(engine: Engine, enabled: bool) -> None:
    """Empty the cache and turn it on or off (between runs, when no request is running)."""
    engine.scheduler.prefix_cache.clear()
    runner = engine.runner
    engine.scheduler.prefix_cache = PrefixCache(runner.token_to_kv_pool, runner.req_to_token_pool, enabled=enabled)


def sync(engine: Engine) -> None:
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()


def run(engine: Engine, prompts: list[list[int]], output_len: int, enabled: bool) -> dict:
    set_cache(engine, enabled)
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
            "prefix_cache": engine.stats()["prefix_cache"], "outputs": [o.token_ids for o in outs]}


def ttft_probe(engine: Engine, ns: argparse.Namespace, vocab: int) -> dict:
    """Median TTFT of an uncached request and of one whose prefix the previous request cached."""
    set_cache(engine, True)
    rng = random.Random(1)
    one = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    cold, warm = [], []
    for _ in range(ns.probes):
        prefix = [rng.randrange(10, vocab) for _ in range(ns.prefix_len)]
        for times in (cold, warm):
            suffix = [rng.randrange(10, vocab) for _ in range(ns.suffix_len)]
            sync(engine)
            start = time.perf_counter()
            engine.generate(input_ids=[prefix + suffix], sampling_params=one)
            sync(engine)
            times.append(time.perf_counter() - start)
    return {"uncached_ttft_s": statistics.median(cold), "cached_ttft_s": statistics.median(warm),
            "ratio": statistics.median(warm) / statistics.median(cold)}


def bench_model(model: str, ns: argparse.Namespace) -> dict:
    settings = dict(load_format="dummy", device=ns.device, dtype=ns.dtype, attention_backend=ns.backend)
    if ns.max_total_tokens:
        settings["max_total_tokens"] = ns.max_total_tokens
    if ns.max_running_requests:
        settings["max_running_requests"] = ns.max_running_requests
    engine = Engine(model, **settings)
    vocab = int(engine.runner.hf_config.vocab_size)
    loads = workloads(ns, vocab)
    run(engine, loads["shared"][: min(8, len(loads["shared"]))], 4, True)  # warm-up (kernels, allocator)
    result = {"model": model, "backends": {k: engine.backends[k] for k in ("device", "dtype")}}
    for name, prompts in loads.items():
        # Off first, then on: neither run profits from the other's cache (set_cache empties it).
        off, on = run(engine, prompts, ns.output_len, False), run(engine, prompts, ns.output_len, True)
        same = sum(a == b for a, b in zip(off.pop("outputs"), on.pop("outputs")))
        result[name] = {"off": off, "on": on, "speedup": on["output_tokens_per_s"] / off["output_tokens_per_s"],
                        "greedy_equal": same, "requests": len(prompts)}
    result["nothing_shared"]["loss"] = 1 - result["nothing_shared"]["speedup"]
    result["ttft"] = ttft_probe(engine, ns, vocab)
    engine.shutdown()
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def table(results: list[dict]) -> str:
    lines = [f"{'model':<14} {'shared tok/s off':>16} {'on':>9} {'ratio':>6} {'hit':>6} "
             f"{'TTFT cached/uncached':>21} {'no-share loss':>13} {'greedy equal':>13}"]
    for r in results:
        s, n, t = r["shared"], r["nothing_shared"], r["ttft"]
        lines.append(f"{r['model']:<14} {s['off']['output_tokens_per_s']:>16.1f} {s['on']['output_tokens_per_s']:>9.1f} "
                     f"{s['speedup']:>5.2f}x {100 * s['on']['prefix_cache']['hit_rate']:>5.1f}% "
                     f"{1000 * t['cached_ttft_s']:>8.1f}/{1000 * t['uncached_ttft_s']:.1f} ms ({t['ratio']:.2f})"
                     f" {100 * n['loss']:>12.1f}% {s['greedy_equal'] + n['greedy_equal']:>6}/{s['requests'] + n['requests']}")
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
