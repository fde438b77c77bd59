"""Decode step latency of a preset, eager vs CUDA graph, per attention backend (GPU).

    python bench/graph_runner.py --model llama-3.2-1b --batch-size 1 8 32 64 --context 512 --out $OUT/graph.json

Side by side in one process: for each backend, the engine's model runner with graphs captured
(capture time and memory recorded), then eager and graph decode steps on identical batches; the
weight-read floor (parameter bytes at the measured copy bandwidth) and Hugging Face transformers'
eager decode step on the same shape as the baseline.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import peak_bytes_per_s  # noqa: E402  (bench/timing.py)


def runner_for(model: str, backend: str, max_bs: int, context: int):
    from backplane.executor.model_runner import ModelRunner
    from backplane.plugin.manager import load_plugins
    from backplane.settings import build_server_args

    plugin_set = load_plugins()
    args = build_server_args(dict(model=model, attention_backend=backend, device="cuda", dtype="bfloat16",
                                  # the default capture ladder (1, 2, 4, 8, ..., 160) is what is timed
                                  max_running_requests=200, cuda_graph_max_bs=160,
                                  max_total_tokens=(max_bs + 1) * (context + 64)),
                             plugin_set.settings_groups(), {})
    runner = ModelRunner(args, plugin_set)
    runner.init_cuda_graphs()
    return runner


def bench_backend(model: str, backend: str, sizes: list[int], context: int, steps: int) -> dict:
    from backplane.cli.bench import measure

    torch.cuda.synchronize()
    start = time.perf_counter()
    runner = runner_for(model, backend, max(sizes), context)
    build_s = time.perf_counter() - start
    gr = runner.graph_runner
    rows = []
    for bs in sizes:
        measure(runner, bs, 64, 3, eager=False)  # warm-up
        for eager in (True, False):
            rows.append(measure(runner, bs, context, steps, eager) | {"backend": backend})
    replay = {bs: replay_ms(gr, bs) for bs in sizes} if gr else {}
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    out = {"backend": backend, "rows": rows, "replay_ms": replay, "capture_s": gr.capture_seconds if gr else None,
           "graph_memory_mb": gr.graph_memory_bytes / 2**20 if gr else None, "captured_sizes": gr.sizes if gr else [],
           "weight_bytes": weight_bytes, "startup_s": build_s}
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    return out


def replay_ms(graph_runner, bs: int, reps: int = 50) -> float:
    """GPU time of the captured decode graph alone (no host-side batch building or sampling)."""
    from backplane.executor.batch import ForwardMode
    from backplane.executor.graph_sizes import GraphKey, padded_size

    graph = graph_runner.graphs[GraphKey(ForwardMode.DECODE, padded_size(bs, graph_runner.sizes), 1)]
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


@torch.inference_mode()
def hf_decode_step_ms(model: str, context: int, bs: int = 1, steps: int = 8) -> float:
    """transformers' eager decode step (with its KV cache) on the same config and random weights."""
    from transformers import AutoModelForCausalLM

    from backplane.models.presets import get_preset

    hf = AutoModelForCausalLM.from_config(get_preset(model), dtype=torch.bfloat16).cuda().eval()
    ids = torch.randint(3, 1000, (bs, context), device="cuda")
    out = hf(ids, use_cache=True)
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = hf(token, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    del hf
    torch.cuda.empty_cache()
    return statistics.median(times[1:]) * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--backends", nargs="+", default=["triton", "flashinfer"])
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    results = [bench_backend(a.model, b, a.batch_size, a.context, a.steps) for b in a.backends]
    hf_ms = hf_decode_step_ms(a.model, a.context)
    floor_ms = results[0]["weight_bytes"] / peak_bytes_per_s() * 1e3
    print(f"\n{a.model}, context {a.context}, bf16; weight-read floor {floor_ms:.3f} ms; "
          f"transformers eager decode step at batch 1: {hf_ms:.2f} ms")
    print(f"{'backend':>10} {'bs':>4} {'eager ms':>9} {'graph ms':>9} {'eager/graph':>11} {'graph/floor':>11} "
          f"{'HF/graph':>9} {'replay ms':>9} {'replay/floor':>12}")
    for res in results:
        by = {(r["batch_size"], r["mode"]): r["decode_step_ms"] for r in res["rows"]}
        for bs in a.batch_size:
            e, g = by[(bs, "eager")], by[(bs, "graph")]
            print(f"{res['backend']:>10} {bs:>4} {e:>9.3f} {g:>9.3f} {e / g:>11.2f} {g / floor_ms:>11.2f} "
                  f"{(hf_ms / g if bs == 1 else float('nan')):>9.1f} {res['replay_ms'][bs]:>9.3f} "
                  f"{res['replay_ms'][bs] / floor_ms:>12.2f}")
        print(f"{res['backend']:>10} capture {res['capture_s']:.1f} s for {len(res['captured_sizes'])} sizes, "
              f"{res['graph_memory_mb']:.0f} MB")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"model": a.model, "context": a.context, "floor_ms": floor_ms, "hf_step_ms_bs1": hf_ms,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
