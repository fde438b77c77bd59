"""Multi-LoRA decode against its targets, side by side in one process (issue 23; GPU, or CPU smoke).

Steps (dummy weights of `--model`, CUDA graphs, `--adapters` PEFT adapters on all seven
projections, request i on adapter i mod N), per batch size and interleaved in rounds so that host
noise hits every variant alike:

  base       a runner without LoRA
  lora-off   the rank-16 LoRA runner, every request base only (its LoRA-off graph)   target <= 1.03x base
  lora-rR    the rank-R LoRA runner, every request on an adapter (LoRA-on graph)     target <= 1.15x base
  folded-rR  the same with --triton-lora.decode-path folded (--folded)                target <= 1.15x base

Kernels: per layer, the four projection groups' LoRA (fused decode kernel, and the segmented
kernels for comparison) at T tokens on min(T, N) distinct adapters, timed in CUDA graphs, against
the read floor: the bytes of those adapters' A and B over 4.3 TB/s (target: within 4x). Each
group is checked against torch_native first. Then both paths at the fused path's token limit
(64), and a small sweep of the fused kernel's launch settings at the largest T.

    python bench/lora_decode.py --out $OUT/lora_decode.json
    TRITON_INTERPRET=1 python bench/lora_decode.py --device cpu --model tiny-llama --batch-sizes 1 3 \\
        --ranks 8 --adapters 2 --steps 2 --rounds 1 --threshold-tokens 4 --no-sweep   # CPU smoke (eager)
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lora import projection_shapes, write_dummy_adapter  # noqa: E402  (bench/lora.py)
import lora_decode_kernels  # noqa: E402
from lora_decode_kernels import kernel_report, sweep_fused, tune_fused  # noqa: E402
from timing import device_kernels  # noqa: E402  (bench/timing.py)

TARGETS = {"lora": 1.15, "lora-off": 1.03, "kernels_vs_floor": 4.0}
PROFILES: dict[int, dict] = {}  # batch size -> profile_steps' report (--profile)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=8, help="timed decode steps per variant and round")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--no-sweep", action="store_true", help="skip the fused kernel's launch-setting sweep")
    p.add_argument("--threshold-tokens", type=int, default=64,
                   help="also time fused vs segmented here (the fused path's limit), first rank")
    p.add_argument("--tune", metavar="TABLE.json", default=None,
                   help="first time every launch setting of the fused kernel at --batch-sizes x --ranks, write "
                        "the fastest as a tuned table here (plugins/lora_triton/tuned.py), then measure with it")
    p.add_argument("--configs", metavar="TABLE.json", default=None,
                   help="the tuned table the runners and kernels use (default: the plugin's bundled one for this GPU)")
    p.add_argument("--profile", action="store_true",
                   help="torch.profiler over the steps at the smallest batch size: each variant's kernels per step")
    p.add_argument("--folded", action="store_true",
                   help="also time LoRA-on steps with --triton-lora.decode-path folded (folded-rR: the shrink in "
                        "the base GEMM over [W; A], then one expand kernel per projection group)")
    p.add_argument("--out", default=None, help="write the JSON report here")
    return p.parse_args()


def build_runner(ns, lora_paths: list[str], rank: int, decode_path: str = "fused"):
    from backplane.executor.model_runner import ModelRunner
    from backplane.lora.manager import attach_lora
    from backplane.plugin.manager import load_plugins
    from backplane.settings import build_server_args

    plugin_set = load_plugins()
    max_bs = max(ns.batch_sizes)
    cuda = ns.device == "cuda"
    kwargs = dict(model=ns.model, device=ns.device, dtype="bfloat16" if cuda else "float32",
                  # two sessions on the first LoRA runner (lora-off and lora-on) at a time
                  max_running_requests=2 * max_bs, cuda_graph_bs=sorted(ns.batch_sizes),
                  max_total_tokens=2 * max_bs * (ns.input_len + ns.rounds * ns.steps + 16),
                  chunked_prefill_size=max(max_bs * ns.input_len, 8192), lora_paths=lora_paths,
                  lora_backend="triton", max_loras_per_batch=ns.adapters, max_lora_rank=rank)
    lora_options = {"configs": ns.configs} if ns.configs else {}
    lora_options["decode_path"] = decode_path
    options = {"triton-lora": lora_options}
    runner = ModelRunner(build_server_args(kwargs, plugin_set.settings_groups(), options), plugin_set)
    manager = attach_lora(runner)
    runner.init_cuda_graphs()
    if cuda and runner.graph_runner is None:
        raise RuntimeError("no CUDA graphs were captured; the step targets are for graph decode")
    return runner, manager


class Session:
    """One runner's batch of `bs` requests, prefilled; `step()` times one decode step as the
    scheduler runs it (build the batch, let the LoRA manager prepare it, run, synchronize)."""

    def __init__(self, runner, manager, adapters: list[str | None], input_len: int) -> None:
        from backplane.engine.batch_builder import build_extend_batch
        from backplane.engine.request import Req
        from backplane.engine.sampling_params import SamplingParams

        self.runner, self.manager, self.keys, self.prep = runner, manager, set(), []
        gen = torch.Generator().manual_seed(len(adapters))
        vocab = int(runner.hf_config.vocab_size)
        self.reqs = [Req(i, torch.randint(3, vocab, (input_len,), generator=gen).tolist(), SamplingParams(), a)
                     for i, a in enumerate(adapters)]
        for req in self.reqs:
            req.row = runner.req_to_token_pool.alloc()
        batch = self._prepared(build_extend_batch(self.reqs, [input_len] * len(self.reqs),
                                                  runner.token_to_kv_pool, runner.req_to_token_pool))
        for req in self.reqs:
            req.num_cached = input_len
        self.tokens = runner.forward(batch).logits.argmax(-1).tolist()

    def _prepared(self, batch):
        if self.manager is not None:
            self.manager.prepare_batch(batch, self.reqs)
        return batch

    @torch.inference_mode()
    def step(self) -> float:
        from backplane.engine.batch_builder import build_decode_batch

        sync = torch.cuda.synchronize if self.runner.device.type == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        for req, token in zip(self.reqs, self.tokens):
            req.output_ids.append(token)
        batch = self._prepared(build_decode_batch(self.reqs, self.runner.token_to_kv_pool,
                                                  self.runner.req_to_token_pool))
        for req in self.reqs:
            req.num_cached += 1
        self.prep.append(time.perf_counter() - start)  # the scheduler's side: batch and LoRA info
        logits = self.runner.forward(batch).logits
        sync()
        elapsed = time.perf_counter() - start
        graphs = self.runner.graph_runner
        self.keys.add(str(dict(graphs.key_for(batch).extras)) if graphs and graphs.key_for(batch) else "eager")
        self.tokens = logits.argmax(-1).tolist()
        return elapsed

    def close(self) -> None:
        for req in self.reqs:
            self.runner.token_to_kv_pool.free(torch.cat(req.slots))
            self.runner.req_to_token_pool.free(req.row)


def time_steps(ns, runners: dict, bs: int) -> dict:
    """Interleaved rounds of every variant at batch size `bs`; median and min step in ms."""
    names = [f"a{i % ns.adapters}" for i in range(bs)]
    sessions = {"base": Session(*runners["base"], [None] * bs, ns.input_len)}
    first = f"r{ns.ranks[0]}"
    sessions["lora-off"] = Session(*runners[first], [None] * bs, ns.input_len)
    for rank in ns.ranks:
        sessions[f"lora-r{rank}"] = Session(*runners[f"r{rank}"], names, ns.input_len)
        if f"f{rank}" in runners:
            sessions[f"folded-r{rank}"] = Session(*runners[f"f{rank}"], names, ns.input_len)
    times = {name: [] for name in sessions}
    profile = None
    try:
        for s in sessions.values():  # warm-up
            for _ in range(3):
                s.step()
        gc.collect()
        gc.disable()
        for _ in range(ns.rounds):
            for name, s in sessions.items():
                times[name] += [s.step() for _ in range(ns.steps)]
        if ns.profile and bs == min(ns.batch_sizes):
            profile = profile_steps(sessions, ns.steps)
    finally:
        gc.enable()
        for s in sessions.values():
            s.close()
    base = statistics.median(times["base"])
    if profile is not None:
        PROFILES[bs] = profile
    return {name: {"step_ms": statistics.median(t) * 1e3, "min_ms": min(t) * 1e3,
                   "x_base": statistics.median(t) / base, "prepare_ms": statistics.median(sessions[name].prep) * 1e3,
                   "graphs": sorted(sessions[name].keys)}
            for name, t in times.items()}


def profile_steps(sessions: dict, steps: int) -> dict:
    """Per variant: device kernel time and launches per step, and its kernels by total time
    (torch.profiler; CUDA graph replays show their kernels one by one)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = next(iter(sessions.values())).runner.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    report = {}
    for name, session in sessions.items():
        with profile(activities=activities) as prof:
            wall = sum(session.step() for _ in range(steps))
        rows = device_kernels(prof, steps)
        report[name] = {"wall_ms": wall * 1e3 / steps, "kernel_ms": sum(r[1] for r in rows),
                        "launches": sum(r[2] for r in rows), "kernels": [list(r) for r in rows[:40]]}
    return report


def format_profile(profile: dict, bs: int) -> list[str]:
    lines = [f"profile at bs {bs}, per step: wall ms | device kernel ms | kernel launches"]
    for name, p in profile.items():
        lines.append(f"  {name:<9} {p['wall_ms']:7.3f} {p['kernel_ms']:7.3f} {p['launches']:6.0f}")
    base = {k: (ms, n) for k, ms, n in profile["base"]["kernels"]}
    for name, p in profile.items():
        if name == "base":
            continue
        extra = [(k, ms - base.get(k, (0.0, 0))[0], n - base.get(k, (0.0, 0))[1]) for k, ms, n in p["kernels"]]
        extra = sorted((e for e in extra if e[1] > 0.005), key=lambda e: -e[1])[:6]
        lines.append(f"  {name} beyond base: " + "; ".join(f"{k[:48]} +{ms:.3f} ms (+{n:.0f})" for k, ms, n in extra))
    return lines


def measure_steps(ns) -> dict:
    from backplane.models.presets import get_preset

    config = get_preset(ns.model)
    runners = {"base": build_runner(ns, [], max(ns.ranks))}
    with tempfile.TemporaryDirectory() as tmp:
        for rank in ns.ranks:
            paths = []
            for i in range(ns.adapters):
                path = Path(tmp) / f"r{rank}" / f"a{i}"
                write_dummy_adapter(path, config, rank, seed=i)
                paths.append(f"a{i}={path}")
            runners[f"r{rank}"] = build_runner(ns, paths, rank)
            if ns.folded:
                runners[f"f{rank}"] = build_runner(ns, paths, rank, decode_path="folded")
    return {str(bs): time_steps(ns, runners, bs) for bs in ns.batch_sizes}


def read_floor_ratio(model: str, rank: int, bs: int, adapters: int, folded: bool) -> float:
    """A LoRA-on step's least bytes over the base step's: the base weights plus the A and B of the
    min(bs, adapters) adapters the batch uses (request i on adapter i mod N); the folded path's GEMM
    reads every slot's A. The step ratio cannot go below this on a weight-read-bound decode step."""
    from backplane.models.presets import get_preset

    config = get_preset(model)
    shapes = projection_shapes(config).values()
    layers = config.num_hidden_layers
    embed = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    base = layers * sum(n_in * n_out for n_in, n_out in shapes) + embed
    used = min(bs, adapters)
    a = layers * rank * sum(n_in for n_in, _ in shapes)
    b = layers * rank * sum(n_out for _, n_out in shapes)
    return (base + (adapters if folded else used) * a + used * b) / base


def verdicts(report: dict) -> list[str]:
    lines, cuda = [], report["device_kind"] == "cuda"
    for bs, rows in report["steps"].items():
        for name, row in rows.items():
            target = TARGETS["lora-off"] if name == "lora-off" else TARGETS["lora"] if name != "base" else None
            if target is not None:
                row["meets_target"] = row["x_base"] <= target if cuda else None
                floor = ""
                if name != "lora-off":
                    row["read_floor_x"] = read_floor_ratio(report["model"], int(name.split("-r")[1]), int(bs),
                                                           report["adapters"], name.startswith("folded"))
                    floor = f", read floor {row['read_floor_x']:.3f}x"
                lines.append(f"bs {bs:>3} {name:<9} {row['x_base']:.3f}x base{floor} (target <= {target}x): "
                             f"{_word(row['meets_target'])}")
    for row in report["kernels"]:
        row["meets_target"] = row["fused_vs_floor"] <= TARGETS["kernels_vs_floor"] if cuda else None
        lines.append(f"T {row['tokens']:>3} rank {row['rank']:>2} kernels {row['fused_vs_floor']:.2f}x floor "
                     f"(target <= 4x): {_word(row['meets_target'])}")
        folded_ok = row["folded_vs_floor"] <= TARGETS["kernels_vs_floor"] if cuda else None
        lines.append(f"T {row['tokens']:>3} rank {row['rank']:>2} folded path's LoRA share {row['folded_vs_floor']:.2f}x "
                     f"floor (target <= 4x): {_word(folded_ok)}")
    return lines


def _word(ok) -> str:
    return "n/a (not a GPU run)" if ok is None else "meets" if ok else "MISSES"


def format_tables(report: dict) -> str:
    lines = [f"{report['model']} on {report['device']}: {report['adapters']} adapters on all seven projections, "
             "triton LoRA backend, CUDA graphs", "",
             f"{'bs':>3} {'variant':<10} {'step ms':>8} {'min ms':>7} {'x base':>7} {'prep ms':>7}  graph"]
    for bs, rows in report["steps"].items():
        for name, row in rows.items():
            lines.append(f"{bs:>3} {name:<10} {row['step_ms']:8.3f} {row['min_ms']:7.3f} {row['x_base']:7.3f} "
                         f"{row['prepare_ms']:7.3f}  {', '.join(row['graphs'])}")
            if report["device_kind"] == "cuda" and "eager" in row["graphs"]:
                lines.append(f"    WARNING: some {name} steps at bs {bs} ran eagerly (no captured graph)")
    tuned = any(g["tuned"] for row in report["kernels"] for g in row["groups"].values())
    lines += ["", "LoRA kernels per layer (us): fused decode kernel (" + ("tuned table" if tuned else "no tuned table")
              + ") warm and cold (L2 flushed first, as in a model step) | the read model's launches | segmented "
              "kernels warm and cold | read floor | cold fused / floor | one graph of the four | folded path, cold: "
              "its GEMM over [W; A] and expand less the base GEMM | that / floor",
              f"{'T':>3} {'rank':>4} {'fused':>7} {'cold':>7} {'model':>7} {'segm.':>7} {'cold':>7} {'floor':>6} "
              f"{'fused/floor':>11} {'one graph':>9} {'folded':>7} {'folded/floor':>12}"]
    for row in report["kernels"]:
        lines.append(f"{row['tokens']:>3} {row['rank']:>4} {row['fused_us']:7.2f} {row['fused_cold_us']:7.2f} "
                     f"{row['fused_automatic_us']:7.2f} {row['segmented_us']:7.2f} {row['segmented_cold_us']:7.2f} "
                     f"{row['floor_us']:6.2f} {row['fused_vs_floor']:11.2f} {row['layer_graph_us']:9.2f} "
                     f"{row['folded_cold_us']:7.2f} {row['folded_vs_floor']:12.2f}")
    th = report["threshold"]
    lines.append(f"at the fused path's limit, T {th['tokens']} rank {th['rank']}: fused {th['fused_us']:.2f} us, "
                 f"segmented {th['segmented_us']:.2f} us per layer")
    if report.get("sweep"):
        best = min(report["sweep"], key=lambda r: r["fused_us"])
        auto = next(r for r in report["kernels"] if (r["tokens"], r["rank"]) == (best["tokens"], best["rank"]))
        lines.append(f"fused launch sweep at T {best['tokens']}: best {best['config']} {best['fused_us']:.2f} us per "
                     f"layer (automatic: {auto['fused_us']:.2f} us)")
    for bs, profile in report.get("profile", {}).items():
        lines += [""] + format_profile(profile, int(bs))
    return "\n".join(lines + [""] + verdicts(report))


def main() -> int:
    ns = parse_args()
    if ns.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/lora_decode.py: no CUDA device (for a CPU smoke run: --device cpu, see the docstring)")
    device = torch.device(ns.device)
    report = {"model": ns.model, "adapters": ns.adapters, "device_kind": device.type,
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "args": vars(ns)}
    torch.manual_seed(0)
    if ns.tune:
        table = tune_fused(ns.model, ns.ranks, sorted(ns.batch_sizes), ns.adapters, device)
        Path(ns.tune).write_text(json.dumps(table, indent=2))
        report["tuned"] = table
        ns.configs = ns.tune
    lora_decode_kernels.TUNED_CONFIGS[0] = ns.configs
    report["kernels"] = [kernel_report(ns.model, rank, tokens, ns.adapters, device)
                         for rank in ns.ranks for tokens in ns.batch_sizes]
    report["threshold"] = kernel_report(ns.model, ns.ranks[0], ns.threshold_tokens, ns.adapters, device)
    if not ns.no_sweep:
        report["sweep"] = sweep_fused(ns.model, ns.ranks[0], max(ns.batch_sizes), ns.adapters, device)
    report["steps"] = measure_steps(ns)
    report["profile"] = {str(bs): p for bs, p in PROFILES.items()}
    table = format_tables(report)
    if ns.out:
        Path(ns.out).write_text(json.dumps(report, indent=2))
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
