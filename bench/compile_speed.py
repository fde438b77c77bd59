"""`--enable-torch-compile` against plain CUDA graphs: decode step per batch size and capture time.

    python bench/compile_speed.py --model llama-3.2-1b --backends triton flashinfer --out $OUT/compile.json

For each attention backend, `backplane bench --json` runs in fresh processes, graphs on, alternately
without and with `--enable-torch-compile`, `--repeats` times each (plain, compiled, plain, compiled,
...), on the same batch sizes and lengths. The decode rows compared are the graph-replay rows (`mode`
"graph"): each run's median decode step over `--output-len` steps, then the median over the repeats,
so that a slow process or a clock change hits one sample and not the ratio. Capture time is the
whole default ladder's, compiled sizes (up to `--torch-compile-max-bs`) included; the target is read
on the first compiled run, whose Inductor cache is cold (what a user's first start pays). Later
compiled runs find the cache warm: their step time counts, their capture time is listed apart.

Targets (issue 19, llama-3.2-1b on the GPU): compiled step / uncompiled step <= 1.0 at bs 1, 8 and
32 for triton and flashinfer; capture with compile <= 90 s. JSON to --out, a table last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

TARGETS = {"step_ratio": 1.0, "capture_s": 90.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--backends", nargs="+", default=["triton", "flashinfer"])
    p.add_argument("--batch-size", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="runs of each setting, alternating")
    p.add_argument("--timeout", type=float, default=280.0, help="seconds per `backplane bench` run")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default=None)
    ns = p.parse_args(argv)
    if ns.repeats < 1:
        p.error(f"--repeats: expected a positive number of runs, got {ns.repeats}")
    return ns


def bench_once(ns: argparse.Namespace, backend: str, compile_: bool) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "backplane.cli", "bench", "--json", "--model", ns.model, "--device", ns.device,
           "--attention-backend", backend, "--input-len", str(ns.input_len), "--output-len", str(ns.output_len),
           "--batch-size", *map(str, ns.batch_size)]
    if compile_:
        cmd.append("--enable-torch-compile")
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=ns.timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"backend": backend, "compile": compile_, "error": " | ".join(tail), "wall_s": wall}
    report = json.loads(proc.stdout[proc.stdout.index("{"):])
    mode = "graph" if any(r["mode"] == "graph" for r in report["results"]) else "eager"  # eager: no CUDA
    steps = {r["batch_size"]: r["decode_step_ms"] for r in report["results"] if r["mode"] == mode}
    graph = report["graph"] or {}
    return {"backend": backend, "compile": compile_, "mode": mode, "decode_step_ms": steps, "capture_s": graph.get("capture_s"),
            "graph_batch_sizes": graph.get("batch_sizes"), "graph_memory_mb": graph.get("memory_mb"),
            "graph_mode_limits": report["graph_mode_limits"], "wall_s": wall}


def median_steps(runs: list[dict[str, Any]]) -> dict[int, float]:
    """Batch size -> the median over runs of each run's median decode step (failed runs left out)."""
    per_bs: dict[int, list[float]] = {}
    for run in runs:
        for bs, ms in run.get("decode_step_ms", {}).items():
            per_bs.setdefault(int(bs), []).append(ms)
    return {bs: statistics.median(v) for bs, v in per_bs.items()}


def compare(plain: list[dict[str, Any]], compiled: list[dict[str, Any]], sizes: list[int]) -> list[dict[str, Any]]:
    a_steps, b_steps = median_steps(plain), median_steps(compiled)
    rows = []
    for bs in sizes:
        a, b = a_steps.get(bs), b_steps.get(bs)
        rows.append({"backend": plain[0]["backend"], "batch_size": bs, "graph_ms": a, "compiled_graph_ms": b,
                     "ratio": b / a if a and b else None, "samples": [len(plain), len(compiled)]})
    return rows


def table(runs: list[dict[str, Any]], rows: list[dict[str, Any]]) -> str:
    lines = [f"{'backend':<11} {'bs':>3} {'graphs ms':>10} {'compiled ms':>12} {'ratio':>6}  target <= 1.0"]
    for r in rows:
        fmt = (lambda v, spec: format(v, spec) if v is not None else "-")  # noqa: E731
        lines.append(f"{r['backend']:<11} {r['batch_size']:>3} {fmt(r['graph_ms'], '10.3f'):>10} "
                     f"{fmt(r['compiled_graph_ms'], '12.3f'):>12} {fmt(r['ratio'], '6.3f'):>6}")
    lines.append(f"{'backend':<11} {'compile':>7} {'capture s':>10} {'sizes':>5}  target <= 90 s with compile "
                 "(its first run: a cold Inductor cache)")
    for run in runs:
        if "error" in run:
            lines.append(f"{run['backend']:<11} {'on' if run['compile'] else 'off':>7} failed: {run['error'][:100]}")
            continue
        capture = "no graphs" if run["capture_s"] is None else f"{run['capture_s']:.1f}"
        warm = "  (warm cache)" if run["compile"] and run.get("repeat", 0) > 0 else ""
        lines.append(f"{run['backend']:<11} {'on' if run['compile'] else 'off':>7} {capture:>10} "
                     f"{len(run['graph_batch_sizes'] or []):>5}{warm}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    runs, rows = [], []
    for backend in ns.backends:
        plain, compiled = [], []
        for repeat in range(ns.repeats):
            for runs_of, compile_ in ((plain, False), (compiled, True)):
                run = {**bench_once(ns, backend, compile_), "repeat": repeat}
                runs_of.append(run)
                print(f"run {backend} compile={'on' if compile_ else 'off'} repeat {repeat}: "  # survives a kill
                      f"{run.get('decode_step_ms') or run.get('error')} capture {run.get('capture_s')} s, "
                      f"wall {run['wall_s']:.0f} s", flush=True)
        runs += [run for pair in zip(plain, compiled) for run in pair]
        rows += compare(plain, compiled, ns.batch_size)
    report = {"model": ns.model, "input_len": ns.input_len, "output_len": ns.output_len, "repeats": ns.repeats,
              "targets": TARGETS, "runs": runs, "rows": rows}
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(report, f, indent=2)
    print(table(runs, rows))
    return 0 if all("error" not in r for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
