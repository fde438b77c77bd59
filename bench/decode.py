"""Decode against its peer: the engine's decode step beside the peer's (bench/peer.py, a torch.compile
Llama loop) at the same batch and context, in one process, per model, attention backend and engine variant.

Engine: the whole Engine.generate loop per step, and the captured decode graph's replay alone. The
variants (VARIANTS) are engines of the same settings but one, built side by side and measured in
interleaved rounds, so host noise hits them alike; their graph capture time and memory are kept. Floor:
the weights' bytes at the card's copy bandwidth. --profile BS splits a step of every variant (and
the peer's kernels) at those batch sizes.

    python -m bench.decode --models llama-3.2-1b llama-3.1-8b --backends triton flashinfer
    python -m bench.decode --variants overlap compiled --rounds 2      # torch.compile against plain graphs
"""

from __future__ import annotations

import argparse
import statistics

import torch

from backplane import Engine
from bench import peer, report, steps
from bench.timing import copy_tb_s
from bench.workload import weight_bytes

VARIANTS = {  # name -> the Engine settings that differ from the default engine
    "overlap": {},
    "no-overlap": {"disable_overlap_schedule": True},
    "compiled": {"enable_torch_compile": True},
    "tensor-cores": {"plugin_options": {"flashinfer": {"decode_use_tensor_cores": "true"}}},
    "cuda-cores": {"plugin_options": {"flashinfer": {"decode_use_tensor_cores": "false"}}},
    "fp8": {"quantization": "fp8"},  # the bf16 checkpoint quantized at load: per-channel weights, per-token acts
    "fp8-block": {"quantization": "fp8", "plugin_options": {"fp8": {"online_block": "128x128"}}},  # DeepSeek's blocks
    # the same two without programmatic dependent launch of the FP8 GEMMs (on by default on Hopper)
    "fp8-nopdl": {"quantization": "fp8", "plugin_options": {"fp8": {"pdl": False}}},
    "fp8-block-nopdl": {"quantization": "fp8", "plugin_options": {"fp8": {"online_block": "128x128", "pdl": False}}},
    "fp8-kv": {"kv_cache_dtype": "fp8_e4m3"},
}
DEFAULT_VARIANTS = ("overlap", "no-overlap")
COLUMNS = [("model", "model", ""), ("backend", "backend", ""), ("variant", "variant", ""), ("bs", "batch_size", "d"),
           ("peer ms", "peer_ms", ".3f"), ("engine ms", "engine_ms", ".3f"), ("engine/peer", "ratio", ".2f"),
           ("/first variant", "vs_first", ".2f"),
           ("replay ms", "replay_ms", ".3f"), ("replay/floor", "replay_floor", ".2f"),
           ("step/floor", "step_floor", ".2f")]
PROFILE_COLUMNS = COLUMNS[:4] + [("wall ms", "wall_ms", ".3f"), ("kernels ms", "kernel_ms", ".3f"),
                                 ("host or gaps ms", "host_or_gap_ms", ".3f"), ("launches", "launches", ".0f")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = report.parser(__doc__)
    p.add_argument("--models", nargs="+", default=["llama-3.2-1b", "llama-3.1-8b"])
    p.add_argument("--backends", nargs="+", default=["triton", "flashinfer"])
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(DEFAULT_VARIANTS))
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds over the variants (medians)")
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel engines (the peer runs on one GPU)")
    p.add_argument("--no-compile", action="store_true", help="run the peer eagerly (CPU smoke runs)")
    p.add_argument("--no-peer", action="store_true", help="variants against each other only (no peer loop)")
    p.add_argument("--profile", type=int, nargs="*", default=[], metavar="BS", help="profile a step at these sizes")
    return p.parse_args(argv)


def engine_settings(ns: argparse.Namespace, model: str, backend: str, variant: str) -> dict:
    # The pool holds every request's context and steps once, plus room for the radix cache's
    # leftovers; twice that (the old size) did not fit two 8B engines at bs 8 x 16k on an 80 GB card.
    bs = max(ns.batch_sizes)
    return dict(model=model, device=ns.device, attention_backend=backend, max_running_requests=bs,
                max_total_tokens=bs * (ns.context + ns.steps + 64) + 8192, cuda_graph_bs=ns.batch_sizes,
                chunked_prefill_size=max(8192, ns.context), tp_size=ns.tp_size, **VARIANTS[variant])


def measure_engines(ns: argparse.Namespace, engines: dict[str, Engine], tb_s: float) -> tuple[list[dict], dict]:
    """Rows (one per variant and batch size) and each variant's graph capture, of engines built side by side."""
    floor = weight_bytes(engines[ns.variants[0]].runner.model) / (tb_s * 1e12) * 1e3
    samples = steps.interleaved(engines, ns.batch_sizes, ns.rounds,
                                lambda v, bs: steps.engine_step_ms(engines[v], bs, ns.context, ns.steps))
    rows = [measure_row(ns, engines[v], bs, ms) | {"variant": v, "floor_ms": floor}
            for (v, bs), ms in samples.items()]
    first = {r["batch_size"]: r["engine_ms"] for r in rows if r["variant"] == ns.variants[0]}
    for row in rows:  # each variant's step over the first variant's, same batch size, same rounds
        row["vs_first"] = row["engine_ms"] / first[row["batch_size"]]
    return rows, {v: steps.graph_capture(e) for v, e in engines.items()}


def measure_row(ns: argparse.Namespace, engine: Engine, bs: int, runs_ms: list[float]) -> dict:
    """One variant at one batch size: its step (median of the rounds), replay, and a profile (--profile)."""
    row = {"batch_size": bs, "engine_ms": statistics.median(runs_ms), "engine_runs_ms": runs_ms,
           "replay_ms": steps.replay_ms(engine, bs)}
    if bs in ns.profile:
        row["profile"] = steps.profile_step(engine, bs, ns.context)
    print(f"bs {bs}: engine {row['engine_ms']:.3f} ms, replay {row['replay_ms']}", flush=True)
    return row


def add_peer(ns: argparse.Namespace, model: str, rows: list[dict]) -> None:
    """The peer at each batch size, then the ratios, beside every row."""
    from backplane.models.presets import get_preset

    cfg, device, peers = get_preset(model), torch.device(ns.device), {}
    for bs in ns.batch_sizes:
        ms, kernels = peer.decode_ms(cfg, bs, ns.context, ns.steps, device, not ns.no_compile, bs in ns.profile)
        peers[bs] = {"peer_ms": ms, "peer_profile": kernels}
        print(f"peer {model} bs {bs}: {ms:.3f} ms", flush=True)
    for row in rows:
        row.update(peers[row["batch_size"]])
    report.add_ratios(rows, {"ratio": ("engine_ms", "peer_ms"), "replay_floor": ("replay_ms", "floor_ms"),
                             "step_floor": ("engine_ms", "floor_ms")})


def result_subject(ns: argparse.Namespace, model: str) -> str:
    """The result file's subject: the model, and the variants unless they are the default pair, so two
    runs of one call with other variants (bench.run's quant-decode: FP8 weights, then FP8 KV) keep
    both files."""
    variants = tuple(ns.variants)
    return model if variants == DEFAULT_VARIANTS else f"{model}-{'-'.join(variants)}"


def main(argv: list[str] | None = None) -> list[dict]:
    ns = parse_args(argv)
    tb_s = copy_tb_s(ns.device)
    print(f"device copy bandwidth {tb_s:.2f} TB/s (the floors')")
    all_rows = []
    for model in ns.models:
        rows, captures = [], {}
        for backend in ns.backends:
            settings = {v: engine_settings(ns, model, backend, v) for v in ns.variants}
            backend_rows, captures[backend] = steps.with_engines(settings, lambda e: measure_engines(ns, e, tb_s))
            rows += [r | {"model": model, "backend": backend} for r in backend_rows]
            payload = {"args": vars(ns), "copy_tb_s": tb_s, "captures": captures, "rows": rows}
            report.write_result("decode", result_subject(ns, model), payload, ns.out, ns.device)  # a run cut short keeps these
        if not ns.no_peer:
            add_peer(ns, model, rows)
        report.write_result("decode", result_subject(ns, model), payload, ns.out, ns.device)
        all_rows += rows
    profiles = [r | r["profile"] for r in all_rows if r.get("profile")]
    print(report.table(profiles, PROFILE_COLUMNS, "one step under the profiler (top kernels and idle gaps: the JSON)"))
    print(report.table(all_rows, COLUMNS))
    return all_rows


if __name__ == "__main__":
    main()
