"""End-to-end offline throughput: the Engine with graphs on, per attention backend, against
transformers' batched `generate` on the same shapes in the same process, and the physical floor.

    python bench/e2e.py --model llama-3.2-1b --out $OUT/e2e.json
    python bench/e2e.py --model tiny-llama --device cpu --backends torch_native --requests 8 \
        --fixed-shape 32 8 --hf-requests 4          # a smoke run on CPU

Workloads: "fixed" (256 requests of 1024 input / 256 output tokens) and "sharegpt-like" (256
requests with log-normal input and output lengths, a chat-like mix; seeded). Reported per backend:
output tokens/s, the median over requests of the time per output token (TPOT, first token
excluded), the median time to first token, and the ratios to transformers and to the floor.

transformers runs the first `--hf-requests` requests of the workload as one left-padded batch
(greedy, every row generating the longest output asked for; only the asked-for tokens count): its
per-step cost is mostly Python and kernel launches, so a slice of the workload gives its rate
without spending minutes of device time.

The floor is the time the workload needs if every decode step only reads the weights once and the
KV of the requests still running (all requests in one batch, at the measured copy bandwidth), and
the prefill only does the weights' matmul FLOPs at the measured bf16 matmul peak.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import H200_COPY_TB_S, copy_bandwidth_tb_s  # noqa: E402  (bench/timing.py)

MATMUL_PEAK = 680e12  # FLOP/s, bf16 8192^3 matmul, lower end of the measured range


def workload(kind: str, n: int, fixed_shape: tuple[int, int], seed: int = 0) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    if kind == "fixed":
        return [fixed_shape] * n
    clamp = lambda v, lo, hi: max(lo, min(hi, int(v)))  # noqa: E731
    return [(clamp(rng.lognormvariate(5.5, 1.0), 4, 2048), clamp(rng.lognormvariate(5.0, 0.8), 4, 512))
            for _ in range(n)]


def prompts_for(shapes, vocab: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n_in,), generator=gen).tolist() for n_in, _ in shapes]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def model_sizes(config, dtype_bytes: int = 2) -> tuple[int, int]:
    """(KV bytes per token, parameters in the per-token matmuls) of a Llama-family config.

    The per-token matmuls are q/k/v/o and gate/up/down of every layer; the lm_head runs once per
    request in a prefill, so it is left out of the prefill FLOPs.
    """
    from backplane.models.config_utils import head_dim_of, num_kv_heads_of

    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    q, kv = config.num_attention_heads * head_dim_of(config), num_kv_heads_of(config) * head_dim_of(config)
    kv_per_token = layers * 2 * kv * dtype_bytes
    matmul_params = layers * (hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter)
    return kv_per_token, matmul_params


def floor_seconds(shapes, weight_bytes: int, kv_per_token: int, matmul_params: int, copy_tb_s: float) -> float:
    """Decode: one weight read per step plus the running requests' KV at copy_tb_s (the device's measured
    copy bandwidth); prefill: 2 * params * tokens FLOPs at MATMUL_PEAK."""
    decode_bytes = 0
    for step in range(max(n_out for _, n_out in shapes) - 1):  # the first token comes from the prefill
        running = [(n_in, n_out) for n_in, n_out in shapes if n_out - 1 > step]
        decode_bytes += weight_bytes + kv_per_token * sum(n_in + 1 + step for n_in, _ in running)
    prefill_flops = 2.0 * matmul_params * sum(n_in for n_in, _ in shapes)
    return decode_bytes / (copy_tb_s * 1e12) + prefill_flops / MATMUL_PEAK


def run_engine(ns, backend: str, shapes) -> dict:
    from backplane import Engine, SamplingParams

    # Graphs up to the running batch: past --cuda-graph-max-bs (160 by default) a decode step runs
    # eagerly, which on a small model costs several times the replayed step.
    engine = Engine(ns.model, device=ns.device, attention_backend=backend, max_running_requests=ns.max_running,
                    cuda_graph_max_bs=ns.cuda_graph_max_bs or ns.max_running)
    runner = engine.runner
    prompts = prompts_for(shapes, int(runner.hf_config.vocab_size))
    params = [SamplingParams(max_new_tokens=n_out, temperature=0, ignore_eos=True) for _, n_out in shapes]
    # Warm-up: the same requests twice, so the second pass takes the cached-prefix path too (a
    # backend that JIT-builds a module per path builds it here, not in the timed run); then the
    # cache is emptied so the timed run finds nothing of the warm-up's.
    for _ in range(2):
        engine.generate(input_ids=prompts[:4], sampling_params=params[:4])
    # --repeats: the whole workload again, each on an emptied prefix cache; the row is the median
    # run, and the spread tells a one-off cost (a first-use compile, say) from the steady state.
    runs = []
    for _ in range(ns.repeats):
        engine.scheduler.prefix_cache.clear()
        _sync(ns.device)
        start = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        _sync(ns.device)
        runs.append((time.perf_counter() - start, outs))
        errors = [o.error for o in outs if o.error]
        if errors:
            raise RuntimeError(f"{backend}: {len(errors)} requests failed, first: {errors[0]}")
    elapsed, outs = sorted(runs, key=lambda r: r[0])[(len(runs) - 1) // 2]
    tokens = sum(len(o.token_ids) for o in outs)
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    kv_per_token, matmul_params = model_sizes(runner.hf_config, runner.token_to_kv_pool.k_buffers[0].element_size())
    row = {"backend": backend, "output_tokens": tokens, "seconds": elapsed, "tok_s": tokens / elapsed,
           "tpot_ms": statistics.median(o.tpot_s for o in outs if o.tpot_s is not None) * 1e3,
           "ttft_ms": statistics.median(o.ttft_s for o in outs) * 1e3,
           "graphs": runner.graph_runner is not None, "runs_s": [r[0] for r in runs],
           "floor_s": floor_seconds(shapes, weight_bytes, kv_per_token, matmul_params, ns.copy_tb_s),
           "weight_bytes": weight_bytes, "kv_bytes_per_token": kv_per_token}
    del engine, runner
    gc.collect()
    if ns.device == "cuda":
        torch.cuda.empty_cache()
    return row


@torch.inference_mode()
def run_transformers(ns, shapes) -> dict:
    """Greedy batched generate of the first `ns.hf_requests` requests (left padding)."""
    from transformers import AutoModelForCausalLM

    from backplane.models.presets import get_preset

    dtype = torch.bfloat16 if ns.device == "cuda" else torch.float32
    with torch.device(ns.device):  # random init on the device: seconds, not minutes, for 8B
        hf = AutoModelForCausalLM.from_config(get_preset(ns.model), dtype=dtype).eval()
    shapes = shapes[: ns.hf_requests]
    prompts = prompts_for(shapes, hf.config.vocab_size)
    longest = max(n for _, n in shapes)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=ns.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=ns.device)
    hf.generate(ids[:, -8:], attention_mask=mask[:, -8:], max_new_tokens=2, do_sample=False, pad_token_id=0)
    _sync(ns.device)
    start = time.perf_counter()
    hf.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                pad_token_id=0)
    _sync(ns.device)
    elapsed = time.perf_counter() - start
    tokens = sum(n for _, n in shapes)
    del hf
    gc.collect()
    return {"backend": "transformers", "requests": len(shapes), "output_tokens": tokens, "seconds": elapsed,
            "tok_s": tokens / elapsed, "step_ms": elapsed / longest * 1e3}


def refloor(path: str) -> None:
    """Recompute the floor columns of a report written by an earlier version of this script."""
    from backplane.models.presets import get_preset

    report = json.loads(open(path).read())
    kv_per_token, matmul_params = model_sizes(get_preset(report["model"]))
    for kind, work in report["workloads"].items():
        requests = work["requests"]
        shapes = workload(kind, requests, tuple(report.get("fixed_shape", (1024, 256))))
        for r in work["rows"]:
            if "weight_bytes" in r:
                r["kv_bytes_per_token"] = kv_per_token
                r["floor_s"] = floor_seconds(shapes, r["weight_bytes"], kv_per_token, matmul_params,
                                            report.get("copy_tb_s", H200_COPY_TB_S))
                r["floor_tok_s"] = r["output_tokens"] / r["floor_s"]
                r["vs_floor"] = r["tok_s"] / r["floor_tok_s"]
    report["floor_recomputed"] = True
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--backends", nargs="+", default=["triton", "flashinfer"])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--max-running", type=int, default=256)
    p.add_argument("--cuda-graph-max-bs", type=int, default=None, help="default: --max-running")
    p.add_argument("--fixed-shape", type=int, nargs=2, default=(1024, 256), metavar=("INPUT", "OUTPUT"))
    p.add_argument("--workloads", nargs="+", default=["fixed", "sharegpt-like"])
    p.add_argument("--hf-requests", type=int, default=64, help="requests transformers runs (0: skip it)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs of the workload per backend (median reported)")
    p.add_argument("--out", default=None)
    p.add_argument("--refloor", metavar="REPORT.json", help="only recompute the floor columns of a report")
    ns = p.parse_args()
    if ns.refloor:
        return refloor(ns.refloor)
    device_name = torch.cuda.get_device_name() if ns.device == "cuda" else "cpu"
    ns.copy_tb_s = copy_bandwidth_tb_s(ns.device)
    report = {"model": ns.model, "device": device_name, "torch": torch.__version__, "copy_tb_s": ns.copy_tb_s,
              "date": time.strftime("%Y-%m-%d"), "fixed_shape": list(ns.fixed_shape), "workloads": {}}
    lines = []
    for kind in ns.workloads:
        shapes = workload(kind, ns.requests, tuple(ns.fixed_shape))
        rows = [run_engine(ns, b, shapes) for b in ns.backends]
        hf = run_transformers(ns, shapes) if ns.hf_requests > 0 else None
        if hf:
            rows.append(hf)
        for r in rows:
            r["vs_transformers"] = r["tok_s"] / hf["tok_s"] if hf else None
            if "floor_s" in r:
                r["floor_tok_s"] = r["output_tokens"] / r["floor_s"]
                r["vs_floor"] = r["tok_s"] / r["floor_tok_s"]
        report["workloads"][kind] = {"requests": ns.requests, "input_tokens": sum(i for i, _ in shapes),
                                     "output_tokens": sum(o for _, o in shapes), "rows": rows}
        lines.append(f"{ns.model} {kind}: {ns.requests} requests, {sum(i for i, _ in shapes)} input / "
                     f"{sum(o for _, o in shapes)} output tokens on {device_name}")
        lines.append(f"{'backend':>13} {'tok/s':>9} {'TPOT ms':>8} {'TTFT ms':>8} {'x HF':>6} {'floor tok/s':>11} "
                     f"{'of floor':>8}")
        for r in rows:
            vs_hf = f"{r['vs_transformers']:.1f}" if r["vs_transformers"] else "-"
            floor = f"{r['floor_tok_s']:>11.0f} {r['vs_floor']:>8.0%}" if "floor_s" in r else f"{'-':>11} {'-':>8}"
            tpot = f"{r['tpot_ms']:>8.2f}" if "tpot_ms" in r else f"{r['step_ms']:>8.2f}"
            ttft = f"{r['ttft_ms']:>8.0f}" if "ttft_ms" in r else f"{'-':>8}"
            runs = f"  runs s: {' '.join(f'{t:.2f}' for t in r['runs_s'])}" if len(r.get("runs_s", ())) > 1 else ""
            lines.append(f"{r['backend']:>13} {r['tok_s']:>9.0f} {tpot} {ttft} {vs_hf:>6} {floor}{runs}")
        if hf:
            lines.append(f"  (transformers: first {hf['requests']} requests in one batch; its TPOT column is its step time)")
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(report, f, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
