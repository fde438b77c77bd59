"""Engine decode step, A/B: one measurement through the public API only (Engine.generate), so the
same script times two checkouts (a release's tree and this one) in one device call.

A step is the difference of two generate runs of different output lengths at a fixed batch
(prefill cancels), divided by the extra steps; the median of --repeats pairs. Run it once per tree,
each tree's `core/` as `backplane` and `plugins/` as `backplane.plugins` first on PYTHONPATH; each
run appends one JSON line; `--compare FILE` prints after/before per case.

  PYTHONPATH=OLD_TREE python bench/ab_decode.py --label before >> ab.jsonl
  PYTHONPATH=NEW_TREE python bench/ab_decode.py --label after >> ab.jsonl
  python bench/ab_decode.py --compare ab.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from backplane import Engine, SamplingParams


def timed_generate(engine: Engine, bs: int, context: int, new: int) -> float:
    prompts = [[(7 * i + j) % 1000 + 5 for j in range(context)] for i in range(bs)]
    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params=params)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def step_ms(engine: Engine, bs: int, context: int, short: int, long: int, repeats: int) -> float:
    timed_generate(engine, bs, context, long)  # warm-up: caches, allocator
    steps = []
    for _ in range(repeats):
        t_short = timed_generate(engine, bs, context, short)
        t_long = timed_generate(engine, bs, context, long)
        steps.append((t_long - t_short) / (long - short) * 1e3)
    return statistics.median(steps)


def compare(path: str) -> None:
    """after / before of each (model, backend, bs), from the fastest run of each label."""
    rows = [r for line in open(path) if line.strip() for r in json.loads(line)["rows"]]
    best: dict[tuple, float] = {}
    for r in rows:
        key = (r["model"], r["backend"], r["bs"], r["label"])
        best[key] = min(best.get(key, float("inf")), r["step_ms"])
    print(f"{'model':14} {'backend':10} {'bs':>3} {'before ms':>10} {'after ms':>10} {'after/before':>12}")
    for m, b, bs, _ in sorted(k for k in best if k[3] == "before"):
        before, after = best[(m, b, bs, "before")], best.get((m, b, bs, "after"), float("nan"))
        print(f"{m:14} {b:10} {bs:>3} {before:>10.3f} {after:>10.3f} {after / before:>12.3f}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--label", help="before or after (required unless --compare)")
    p.add_argument("--compare", metavar="FILE", help="print after/before from the JSON lines in FILE")
    p.add_argument("--models", nargs="+", default=["llama-3.2-1b"])
    p.add_argument("--backends", nargs="+", default=["triton", "flashinfer"])
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--short", type=int, default=16)
    p.add_argument("--long", type=int, default=80)
    p.add_argument("--repeats", type=int, default=5)
    ns = p.parse_args()
    if ns.compare:
        return compare(ns.compare)
    if not ns.label:
        p.error("--label: expected before or after (or --compare FILE)")
    rows = []
    for model in ns.models:
        for backend in ns.backends:
            engine = Engine(model, load_format="dummy", attention_backend=backend, max_running_requests=64,
                            max_total_tokens=64 * (ns.context + ns.long + 8), disable_radix_cache=True)
            for bs in ns.batch_sizes:
                rows.append({"label": ns.label, "model": model, "backend": backend, "bs": bs,
                             "step_ms": step_ms(engine, bs, ns.context, ns.short, ns.long, ns.repeats)})
            del engine
            torch.cuda.empty_cache()
    print(json.dumps({"rows": rows, "device": torch.cuda.get_device_name(), "torch": torch.__version__}))


if __name__ == "__main__":
    main()
