"""Multi-LoRA decode against the base model's, side by side in one process (engines built side by side,
measured in interleaved rounds so host noise hits every variant alike):

  base       an engine without LoRA
  lora-off   the first rank's LoRA engine, every request base only (its LoRA-off graph)  target <= 1.03x base
  lora-rR    the rank-R engine, fused decode path, request i on adapter i mod N         target <= 1.15x base
  folded-rR  the same with --triton-lora.decode-path folded (the default)               target <= 1.15x base

A step is the whole Engine.generate loop per decode step (bench/steps.py), overlap scheduling off
unless --overlap. Beside each ratio, its read floor: the base weights plus the A and B the batch
uses (the folded GEMM reads every slot's A), over the base weights. The kernels alone: bench/lora_kernels.py.

    python -m bench.lora --model llama-3.2-1b --ranks 16 64
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from backplane import Engine
from bench import report, steps
from bench.workload import projection_shapes, write_dummy_adapter

TARGETS = {"lora": 1.15, "lora-off": 1.03}
COLUMNS = [("bs", "batch_size", "d"), ("variant", "variant", ""), ("step ms", "step_ms", ".3f"), ("x base", "x_base", ".3f"),
           ("read floor", "read_floor_x", ".3f"), ("verdict", "verdict", "")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = report.parser(__doc__)
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--paths", nargs="+", choices=["fused", "folded"], default=["fused", "folded"])
    p.add_argument("--lora-backend", default="triton")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=32, help="decode steps per timing")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians)")
    p.add_argument("--overlap", action="store_true", help="overlap scheduling on (off: the host's work is in the step)")
    p.add_argument("--profile", action="store_true", help="profile each variant's step at the smallest batch size")
    return p.parse_args(argv)


def adapter_paths(ns: argparse.Namespace, folder: Path, rank: int) -> list[str]:
    """--lora-paths entries a0..aN-1 of `rank`, written under `folder`."""
    from backplane.models.presets import get_preset

    for i in range(ns.adapters):
        write_dummy_adapter(folder / f"r{rank}" / f"a{i}", get_preset(ns.model), rank, seed=i)
    return [f"a{i}={folder / f'r{rank}' / f'a{i}'}" for i in range(ns.adapters)]


def engine_settings(ns: argparse.Namespace, folder: Path) -> dict[str, dict]:
    """Engine settings per engine: base, then per rank one LoRA engine per decode path (--paths)."""
    bs = max(ns.batch_sizes)
    base = dict(model=ns.model, device=ns.device, max_running_requests=bs, cuda_graph_bs=sorted(ns.batch_sizes),
                max_total_tokens=2 * bs * (ns.input_len + ns.steps + 64), disable_overlap_schedule=not ns.overlap,
                chunked_prefill_size=max(bs * ns.input_len, 8192))
    settings = {"base": base}
    for rank in ns.ranks:
        lora = dict(base, lora_paths=adapter_paths(ns, folder, rank), lora_backend=ns.lora_backend,
                    max_loras_per_batch=ns.adapters, max_lora_rank=rank)
        for path in ns.paths:
            name = f"{'lora' if path == 'fused' else 'folded'}-r{rank}"
            settings[name] = dict(lora, plugin_options={"triton-lora": {"decode_path": path}})
    return settings


def variants(engines: dict[str, Engine]) -> dict[str, tuple[Engine, int | None]]:
    """variant -> (engine, LoRA rank or None); lora-off is the first LoRA engine, every request base only."""
    first = next(name for name in engines if name != "base")
    ranked = {name: (engine, int(name.rsplit("-r", 1)[1])) for name, engine in engines.items() if name != "base"}
    return {"base": (engines["base"], None), "lora-off": (engines[first], None), **ranked}


def read_floor_ratio(model: str, rank: int, bs: int, adapters: int, folded: bool) -> float:
    """A LoRA-on step's least bytes over the base step's: the base weights plus the A and B of the
    min(bs, adapters) adapters the batch uses; the folded path's GEMM reads every slot's A."""
    from backplane.models.presets import get_preset

    config = get_preset(model)
    shapes, layers = projection_shapes(config).values(), config.num_hidden_layers
    embed = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    base = layers * sum(n_in * n_out for n_in, n_out in shapes) + embed
    used = min(bs, adapters)
    a, b = layers * rank * sum(n_in for n_in, _ in shapes), layers * rank * sum(n_out for _, n_out in shapes)
    return (base + (adapters if folded else used) * a + used * b) / base


def verdict(ns: argparse.Namespace, variant: str, x_base: float) -> str:
    """The variant's step against its target (TARGETS); "" for base, "n/a" off the GPU."""
    if variant == "base" or ns.device != "cuda":
        return "" if variant == "base" else "n/a (not a GPU run)"
    target = TARGETS["lora-off" if variant == "lora-off" else "lora"]
    return f"{report.verdict(x_base, target)} (<= {target}x)"


def measure(ns: argparse.Namespace, engines: dict[str, tuple[Engine, int | None]]) -> list[dict]:
    """One row per batch size and variant (interleaved rounds; request i on adapter i mod N on a LoRA engine)."""
    def adapters(name: str, bs: int) -> list[str] | None:
        return [f"a{i % ns.adapters}" for i in range(bs)] if engines[name][1] is not None else None

    samples = steps.interleaved(engines, ns.batch_sizes, ns.rounds, lambda name, bs: steps.engine_step_ms(
        engines[name][0], bs, ns.input_len, ns.steps, adapters(name, bs)))
    rows = []
    for (name, bs), ms in samples.items():
        engine, rank = engines[name]
        step = statistics.median(ms)
        x_base = step / statistics.median(samples[("base", bs)])
        row = {"batch_size": bs, "variant": name, "step_ms": step, "runs_ms": ms, "x_base": x_base,
               "verdict": verdict(ns, name, x_base)}
        if rank is not None:
            row["read_floor_x"] = read_floor_ratio(ns.model, rank, bs, ns.adapters, name.startswith("folded"))
        if ns.profile and bs == min(ns.batch_sizes):
            row["profile"] = steps.profile_step(engine, bs, ns.input_len, lora=adapters(name, bs))
        rows.append(row)
    return sorted(rows, key=lambda r: r["batch_size"])


def lora_summaries(engines: dict[str, Engine]) -> dict[str, dict]:
    """Each engine's LoRA backend as the engine reports it, less the adapters' (temporary) paths."""
    return {name: {k: v for k, v in (engine.backends.get("lora") or {}).items() if k != "adapters"}
            for name, engine in engines.items()}


def main(argv: list[str] | None = None) -> list[dict]:
    ns = parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        rows, summaries = steps.with_engines(engine_settings(ns, Path(folder)),
                                             lambda engines: (measure(ns, variants(engines)), lora_summaries(engines)))
    report.write_result("lora", ns.model, {"args": vars(ns), "backends": summaries, "rows": rows}, ns.out, ns.device)
    print(report.table(rows, COLUMNS, f"{ns.model}: {ns.adapters} adapters on all seven projections, decode steps"))
    return rows


if __name__ == "__main__":
    main()
