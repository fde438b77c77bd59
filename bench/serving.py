"""HTTP serving: `backplane serve` (its engine in a process of its own) under Poisson arrivals at several
request rates, against the offline Engine on the same requests. Everything after `--` is engine flags for
both (BACKPLANE_ENGINE_IN_THREAD=1 measures --engine-in-thread).

    python -m bench.serving --model llama-3.2-1b -- --attention-backend triton

Requests: sharegpt-like lengths clamped to --max-input-len / --max-output-len, random token ids, greedy,
ignore_eos, each one streamed completion (bench/serving_client.py: TTFT, ITL and E2E at p50 and p99). A
finite rate sends min(--num-prompts, rate x --max-duration) of them (at least 8) at Poisson times, `inf`
all at once; then the offline Engine runs the `inf` ones at once, and a prefill probe times one request
of the lowest rate's median input length. Targets (llama-3.2-1b): HTTP tok/s at `inf` >= 0.9 x offline;
the lowest rate's TTFT p50 <= 1.5 x (prefill probe + 5 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path

from backplane.testing.server import LiveServer, ServerStartError, missing_dependencies
from bench import report, steps
from bench.serving_client import Workload, make_workload, rate_name, run_rate, summarize

MIN_REQUESTS_PER_RATE = 8
TARGETS = {"saturation": 0.9, "low_rate_ttft": 1.5, "ttft_allowance_ms": 5.0}
LATENCIES = ("ttft", "itl", "e2e")
COLUMNS = [("rate", "rate", ""), ("ok", "ok", ""), ("tok/s", "tok_s", ".0f")] + [
    (f"{k.upper()} {q} ms", f"{k}_{q}", ".1f") for k in LATENCIES for q in ("p50", "p99")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = report.parser(__doc__)
    p.add_argument("--model", default="llama-3.2-1b", help="preset or model directory")
    p.add_argument("--request-rates", default="1,4,16,inf", help="requests/s, comma-separated; inf: all at once")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--max-duration", type=float, default=30.0, help="seconds of arrivals at a finite rate")
    p.add_argument("--max-input-len", type=int, default=2048)
    p.add_argument("--max-output-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=8, help="requests sent (and run offline) before measuring")
    p.add_argument("--probes", type=int, default=5, help="prefill probes on the offline Engine")
    p.add_argument("--no-offline", action="store_true", help="skip the offline Engine and the prefill probe")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("engine_args", nargs="*", metavar="-- ENGINE_FLAGS", help="for serve and the offline Engine")
    ns = p.parse_args(argv)
    try:
        ns.rates = [float(r) for r in ns.request_rates.split(",")]
    except ValueError:
        ns.rates = []
    if not ns.rates or any(not r > 0 for r in ns.rates):
        p.error(f"--request-rates: expected positive numbers or inf separated by commas, got {ns.request_rates!r}")
    return ns


def vocab_size(model: str) -> int:
    """The vocabulary of --model (a preset or a model directory), read as the engine reads it."""
    from backplane import EngineArgs
    from backplane.executor.model_runner import resolve_model_source

    return int(resolve_model_source(EngineArgs(model=model)).hf_config.vocab_size)


def requests_at(rate: float, ns: argparse.Namespace) -> int:
    """All --num-prompts at inf; else rate x --max-duration, at least MIN_REQUESTS_PER_RATE."""
    count = math.inf if math.isinf(rate) else max(MIN_REQUESTS_PER_RATE, math.ceil(rate * ns.max_duration))
    return min(ns.num_prompts, count)


def workloads(ns: argparse.Namespace, vocab: int) -> tuple[Workload, dict[str, Workload]]:
    """The warm-up (4 output tokens each) and one workload per rate; `inf` is the full one, which the
    offline Engine runs too. Each has its own token ids: no run finds another's prompts in the
    prefix cache. The finite rates take the first lengths of the same draw."""
    def make(n: int, token_seed: int, max_output_len: int = ns.max_output_len) -> Workload:
        return make_workload(n, ns.max_input_len, max_output_len, vocab, ns.seed, token_seed)

    per_rate = {rate_name(r): make(requests_at(r, ns), ns.seed + 1000 + i)
                for i, r in enumerate(ns.rates) if not math.isinf(r)}
    per_rate["inf"] = make(ns.num_prompts, ns.seed + 1)
    return make(ns.warmup, ns.seed + 2000, min(4, ns.max_output_len)), per_rate


async def run_http(url: str, warmup: Workload, per_rate: dict[str, Workload], ns: argparse.Namespace) -> dict:
    """Warm up, then every rate in order; one summary row per rate."""
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits, trust_env=False) as client:
        failed = [r.error for r in await run_rate(client, url, warmup, math.inf, ns.seed) if r.error]
        if failed:
            raise RuntimeError(f"warm-up request failed: {failed[0]}")
        rows = {}
        for i, rate in enumerate(ns.rates):
            name = rate_name(rate)
            rows[name] = summarize(await run_rate(client, url, per_rate[name], rate, ns.seed + 10 + i), rate)
            print(report.table([flat(name, rows[name])], COLUMNS), flush=True)
        return rows


def run_offline(engine_argv: list[str], warmup: Workload, work: Workload, probe_len: int,
                ns: argparse.Namespace) -> dict:
    """On one engine: the warm-up, every request of `work` at once through Engine.generate, then the
    prefill probe (bench/prefill.py's time to first token of one request of `probe_len` tokens)."""
    from backplane.cli import parse_server_args
    from backplane.plugin.manager import load_plugins
    from bench.prefill import engine_prefill_ms

    def measure(engine) -> dict:
        if warmup.prompts:
            engine.generate(input_ids=warmup.prompts, sampling_params=[steps.greedy(n) for n in warmup.output_lens])
        engine.flush_cache()  # as fresh as the server's engine: no warm-up prompts cached
        elapsed, outs = steps.timed_generate(engine, work.prompts, [steps.greedy(n) for n in work.output_lens])
        num_out, probes = sum(len(o.token_ids) for o in outs), max(ns.probes, 1)
        probe = {"input_len": probe_len, "probes": probes, "median_ms": engine_prefill_ms(engine, 1, probe_len, probes)}
        return {"requests": len(outs), "seconds": elapsed, "output_tokens": num_out, "output_tok_s": num_out / elapsed,
                "backends": engine.backends, "outputs": [o.token_ids for o in outs], "prefill_probe": probe}

    plugins = load_plugins()
    return steps.with_engine(dict(model=None, server_args=parse_server_args(engine_argv, plugins), plugin_set=plugins),
                             measure)


def compare(rows: dict[str, dict], offline: dict | None, ns: argparse.Namespace) -> dict:
    """The two targets: saturation throughput ratio and the lowest rate's TTFT against prefill + 5 ms."""
    out: dict = {}
    if offline is None:
        return out
    if "inf" in rows:
        ratio, target = rows["inf"]["output_tok_s"] / offline["output_tok_s"], TARGETS["saturation"]
        same = sum(a == b for a, b in zip(rows["inf"]["outputs"], offline["outputs"]))
        out["saturation"] = {"http_tok_s": rows["inf"]["output_tok_s"], "offline_tok_s": offline["output_tok_s"],
                             "ratio": ratio, "target": target, "met": ratio >= target, "greedy_equal": same,
                             "requests": len(offline["outputs"])}
    low, prefill, target = rate_name(min(ns.rates)), offline["prefill_probe"]["median_ms"], TARGETS["low_rate_ttft"]
    if (ttft := rows[low]["ttft_ms"]["p50"]) is not None:
        budget = prefill + TARGETS["ttft_allowance_ms"]
        out["low_rate_ttft"] = {"rate": low, "ttft_p50_ms": ttft, "prefill_ms": prefill, "budget_ms": budget,
                                "ratio": ttft / budget, "target": target, "met": ttft / budget <= target}
    return out


def flat(name: str, row: dict) -> dict:
    """A row of the printed table: one rate's summary (or the offline Engine's, without latencies)."""
    completed = row.get("completed", row["requests"])
    return {"rate": name, "ok": f"{completed}/{row['requests']}", "tok_s": row["output_tok_s"],
            **{f"{k}_{q}": row.get(f"{k}_ms", {}).get(q) for k in LATENCIES for q in ("p50", "p99")}}


def table(rows: dict[str, dict], offline: dict | None, targets: dict) -> str:
    """The rates' table (and the offline Engine's throughput), then a line per target."""
    lines = [report.table([flat(name, r) for name, r in rows.items()] + ([flat("offline", offline)] if offline else []),
                          COLUMNS)]
    if s := targets.get("saturation"):
        lines.append(f"saturation: HTTP at inf {s['http_tok_s']:.0f} tok/s / offline {s['offline_tok_s']:.0f} tok/s "
                     f"= {s['ratio']:.2f} (target >= {s['target']}: {'met' if s['met'] else 'missed'}); "
                     f"greedy outputs equal {s['greedy_equal']}/{s['requests']}")
    if t := targets.get("low_rate_ttft"):
        lines.append(f"TTFT at rate {t['rate']}: p50 {t['ttft_p50_ms']:.1f} ms / (prefill {t['prefill_ms']:.1f} ms + "
                     f"5 ms) = {t['ratio']:.2f} (target <= {t['target']}: {'met' if t['met'] else 'missed'})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    if missing := missing_dependencies():
        print(f"bench.serving: needs {', '.join(missing)} (the serve extra and httpx), not importable here; "
              "pip install 'backplane-llm[serve]' httpx, or carry a site archive that has them", file=sys.stderr)
        return 2
    engine_argv = ["--model", ns.model, "--device", ns.device, *ns.engine_args]
    try:
        vocab = vocab_size(ns.model)
    except ValueError as err:  # not a preset nor a model directory: one line
        print(f"bench.serving: {err}", file=sys.stderr)
        return 2
    warmup, per_rate = workloads(ns, vocab)
    meta = report.environment(ns.device)
    path = report.result_path("serving", Path(ns.model).name, meta, ns.out)  # the server log beside it
    try:
        server = LiveServer(*engine_argv, log_path=path.with_name(path.stem + "-server.log"),
                            startup_timeout=ns.startup_timeout)
    except ServerStartError as err:  # its message ends with the server's last log lines
        print(f"bench.serving: {err}", file=sys.stderr)
        return 1
    try:
        rows = asyncio.run(run_http(server.url, warmup, per_rate, ns))
    finally:
        exit_code = server.stop()
    probe_len = int(rows[rate_name(min(ns.rates))]["median_input_len"])
    offline = None if ns.no_offline else run_offline(engine_argv, warmup, per_rate["inf"], probe_len, ns)
    targets = compare(rows, offline, ns)
    for section in (*rows.values(), offline or {}):
        section.pop("outputs", None)
    result = {"model": ns.model, "engine_args": engine_argv, "args": {k: v for k, v in vars(ns).items() if k != "rates"},
              "server_exit_code": exit_code, "rates": rows, "offline": offline, "targets": targets}
    path.write_text(json.dumps({"meta": meta, **result}, indent=1))
    print(f"wrote {path}")
    print(table(rows, offline, targets))
    failed = sum(r["requests"] - r["completed"] for r in rows.values())
    return 1 if failed or exit_code not in (None, 0) else 0


if __name__ == "__main__":
    sys.exit(main())
