"""Multi-LoRA decode overhead through the model runner with CUDA graphs (GPU).

Builds `--num-adapters` dummy PEFT adapters (random A/B, rank `--rank`, all seven projections) in a
temporary directory, then for the preset `--model` (dummy weights) times one decode step of a batch
of `--batch-size` requests, adapters interleaved (request i uses adapter i mod N):

  base        a runner without LoRA
  lora-off    the LoRA runner, every request base only (its LoRA-off graph)
  lora        the LoRA runner, every request on an adapter (its LoRA-on graph)

A step is what the scheduler does: build the decode batch, let the LoRA manager prepare it, run
the runner (graph replay), synchronize. Median over `--steps` steps after a warm-up.

    python bench/lora.py --out lora.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

TARGET_RATIO = 1.15
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--num-adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--lora-backend", default="auto")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--out", default=None, help="write the JSON report here")
    return p.parse_args()


def projection_shapes(config) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection of a Llama-family config."""
    from backplane.models.config_utils import head_dim_of, num_kv_heads_of

    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * head_dim_of(config), num_kv_heads_of(config) * head_dim_of(config)
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def write_dummy_adapter(path: Path, config, rank: int, seed: int) -> None:
    """A PEFT adapter directory with random A [r, in] and B [out, r] for every projection."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for proj, (n_in, n_out) in projection_shapes(config).items():
            block = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, n_in, generator=gen) / n_in**0.5).to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = (0.01 * torch.randn(n_out, rank, generator=gen)).to(torch.bfloat16)
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config_json = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJECTIONS),
                   "bias": "none", "use_rslora": False}
    (path / "adapter_config.json").write_text(json.dumps(config_json))


def build_runner(ns: argparse.Namespace, lora_paths: list[str]):
    """A model runner (and its LoRA manager, None without adapters) with graphs for one batch size."""
    from backplane.lora.manager import attach_lora
    from backplane.executor.model_runner import ModelRunner
    from backplane.plugin.manager import load_plugins
    from backplane.settings import build_server_args

    plugin_set = load_plugins()
    kwargs = dict(model=ns.model, device="cuda", dtype="bfloat16", attention_backend=ns.attention_backend,
                  max_running_requests=ns.batch_size, cuda_graph_bs=[ns.batch_size],
                  max_total_tokens=ns.batch_size * (ns.input_len + ns.warmup + ns.steps + 8),
                  lora_paths=lora_paths, lora_backend=ns.lora_backend, max_loras_per_batch=max(ns.num_adapters, 1),
                  max_lora_rank=ns.rank, chunked_prefill_size=max(ns.batch_size * ns.input_len, 8192))
    args = build_server_args(kwargs, plugin_set.settings_groups(), None)
    runner = ModelRunner(args, plugin_set)
    manager = attach_lora(runner)
    runner.init_cuda_graphs()
    if runner.graph_runner is None:
        raise RuntimeError("no CUDA graphs were captured; this benchmark needs graphs (a CUDA device)")
    return runner, manager


@torch.inference_mode()
def time_decode(runner, manager, adapters: list[str | None], ns: argparse.Namespace) -> dict[str, Any]:
    """Prefill the batch, then time decode steps; returns the median step and which graph ran."""
    from backplane.engine.batch_builder import build_decode_batch, build_extend_batch
    from backplane.engine.request import Req
    from backplane.engine.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(0)
    vocab = int(runner.hf_config.vocab_size)
    kv_pool, req_pool = runner.token_to_kv_pool, runner.req_to_token_pool
    reqs = [Req(i, torch.randint(3, vocab, (ns.input_len,), generator=gen).tolist(), SamplingParams(), a)
            for i, a in enumerate(adapters)]
    for req in reqs:
        req.row = req_pool.alloc()

    def prepared(batch):
        if manager is not None:
            manager.prepare_batch(batch, reqs)
        return batch

    try:
        batch = prepared(build_extend_batch(reqs, [ns.input_len] * len(reqs), kv_pool, req_pool))
        for req in reqs:
            req.num_cached = ns.input_len
        tokens = runner.forward(batch).logits.argmax(-1).tolist()
        steps, keys = [], set()
        for step in range(ns.warmup + ns.steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for req, token in zip(reqs, tokens):
                req.output_ids.append(token)
            batch = prepared(build_decode_batch(reqs, kv_pool, req_pool))
            for req in reqs:
                req.num_cached += 1
            logits = runner.forward(batch).logits
            torch.cuda.synchronize()
            if step >= ns.warmup:
                steps.append(time.perf_counter() - start)
            keys.add(runner.graph_runner.key_for(batch))
            tokens = logits.argmax(-1).tolist()
    finally:
        for req in reqs:
            kv_pool.free(torch.cat(req.slots))
            req_pool.free(req.row)
    if None in keys:
        raise RuntimeError("a decode step ran eagerly; expected every step to replay a captured graph")
    return {"decode_step_ms": statistics.median(steps) * 1e3, "min_step_ms": min(steps) * 1e3,
            "graph_keys": sorted(str(dict(k.extras)) for k in keys)}


def measure_base(ns: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The base runner's decode step and its backends; the runner is freed on return."""
    runner, _ = build_runner(ns, [])
    row = time_decode(runner, None, [None] * ns.batch_size, ns)
    return row, runner.backends_summary()


def run(ns: argparse.Namespace) -> dict[str, Any]:
    from backplane.models.presets import get_preset

    config = get_preset(ns.model)
    results: dict[str, Any] = {}
    results["base"], backends = measure_base(ns)
    gc.collect()
    torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i in range(ns.num_adapters):
            write_dummy_adapter(Path(tmp) / f"a{i}", config, ns.rank, seed=i)
            paths.append(f"a{i}={Path(tmp) / f'a{i}'}")
        runner, manager = build_runner(ns, paths)
    names = [f"a{i % ns.num_adapters}" for i in range(ns.batch_size)]
    results["lora-off"] = time_decode(runner, manager, [None] * ns.batch_size, ns)
    results["lora"] = time_decode(runner, manager, names, ns)
    backends["lora"] = manager.summary()
    backends["lora"].pop("adapters")
    base_ms = results["base"]["decode_step_ms"]
    for row in results.values():
        row["ratio_to_base"] = row["decode_step_ms"] / base_ms
    ratio = results["lora"]["ratio_to_base"]
    return {"model": ns.model, "batch_size": ns.batch_size, "num_adapters": ns.num_adapters, "rank": ns.rank,
            "input_len": ns.input_len, "steps": ns.steps, "device": torch.cuda.get_device_name(),
            "backends": backends, "results": results, "target_ratio": TARGET_RATIO,
            "meets_target": ratio <= TARGET_RATIO}


def format_report(report: dict[str, Any]) -> str:
    lora = report["backends"]["lora"]
    lines = [f"{report['model']} on {report['device']}: decode batch {report['batch_size']}, "
             f"{report['num_adapters']} adapters of rank {report['rank']} (all seven projections), "
             f"LoRA backend {lora['backend']} (plugin {lora['plugin']}), CUDA graphs",
             f"{'variant':>9} {'step ms':>9} {'min ms':>8} {'x base':>7}  graph"]
    for name, row in report["results"].items():
        lines.append(f"{name:>9} {row['decode_step_ms']:>9.3f} {row['min_step_ms']:>8.3f} "
                     f"{row['ratio_to_base']:>7.3f}  {', '.join(row['graph_keys']) or '-'}")
    verdict = "meets" if report["meets_target"] else "MISSES"
    lines.append(f"target: lora <= {report['target_ratio']}x base -> {verdict} "
                 f"({report['results']['lora']['ratio_to_base']:.3f}x)")
    return "\n".join(lines)


def main() -> int:
    ns = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/lora.py needs a CUDA GPU")
    report = run(ns)
    print(format_report(report))
    if ns.out:
        Path(ns.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
