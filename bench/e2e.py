"""End-to-end offline throughput (GPU): the Engine with graphs on, per attention backend, against
transformers' batched `generate` on the same shapes in the same process, and the read floor.

    python bench/e2e.py --model llama-3.2-1b --out $OUT/e2e.json

Workloads: "fixed" (256 requests, 1024 input / 256 output tokens) and "sharegpt-like" (256 requests
with log-normal input and output lengths, a mix like chat traffic; seeded). Output tokens/s and the
median time per output token (TPOT) are reported. The floor assumes every decode step reads all
weights once plus the KV of the running batch, at the copy bandwidth.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time

import torch

COPY_BANDWIDTH = 4.30e12


def workload(kind: str, n: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    if kind == "fixed":
        return [(1024, 256)] * n
    clamp = lambda v, lo, hi: max(lo, min(hi, int(v)))  # noqa: E731
    return [(clamp(rng.lognormvariate(5.5, 1.0), 4, 2048), clamp(rng.lognormvariate(5.0, 0.8), 4, 512))
            for _ in range(n)]


def prompts_for(shapes, vocab: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n_in,), generator=gen).tolist() for n_in, _ in shapes]


def run_engine(model: str, backend: str, shapes) -> dict:
    from backplane import Engine, SamplingParams

    engine = Engine(model, device="cuda", attention_backend=backend, max_running_requests=256)
    prompts = prompts_for(shapes, int(engine.runner.hf_config.vocab_size))
    params = [SamplingParams(max_new_tokens=n_out, temperature=0, ignore_eos=True) for _, n_out in shapes]
    engine.generate(input_ids=prompts[:4], sampling_params=params[:4])  # warm-up
    steps: list[float] = []
    last = [time.perf_counter()]

    def progress(_finished):
        now = time.perf_counter()
        steps.append(now - last[0])
        last[0] = now

    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params, progress=progress)
    elapsed = time.perf_counter() - start
    assert all(o.error is None for o in outs)
    tokens = sum(len(o.token_ids) for o in outs)
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return {"backend": backend, "output_tokens": tokens, "seconds": elapsed, "tok_s": tokens / elapsed,
            "median_step_ms": statistics.median(steps) * 1e3, "weight_bytes": weight_bytes}


@torch.inference_mode()
def run_transformers(model: str, shapes, batch: int = 32) -> dict:
    """Batched greedy generate (left padding), the same requests in groups of `batch`."""
    from transformers import AutoModelForCausalLM

    from backplane.models.presets import get_preset

    hf = AutoModelForCausalLM.from_config(get_preset(model), dtype=torch.bfloat16).cuda().eval()
    prompts = prompts_for(shapes, hf.config.vocab_size)
    torch.cuda.synchronize()
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(prompts), batch):
        group, outs = prompts[i:i + batch], [n for _, n in shapes[i:i + batch]]
        width = max(map(len, group))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in group], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device="cuda")
        hf.generate(ids, attention_mask=mask, max_new_tokens=max(outs), min_new_tokens=max(outs),
                    do_sample=False, pad_token_id=0)
        tokens += sum(outs)  # only the tokens each request asked for count
    return {"backend": "transformers", "output_tokens": tokens, "seconds": time.perf_counter() - start,
            "tok_s": tokens / (time.perf_counter() - start)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--backends", nargs="+", default=["triton", "flashinfer"])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--workloads", nargs="+", default=["fixed", "sharegpt-like"])
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    report = {"model": a.model, "device": torch.cuda.get_device_name(), "workloads": {}}
    for kind in a.workloads:
        shapes = workload(kind, a.requests)
        rows = [run_engine(a.model, b, shapes) for b in a.backends]
        if not a.skip_transformers:
            rows.append(run_transformers(a.model, shapes))
        report["workloads"][kind] = rows
        floor_step_ms = rows[0]["weight_bytes"] / COPY_BANDWIDTH * 1e3
        print(f"\n{a.model} {kind}: {a.requests} requests; weight-read floor per decode step {floor_step_ms:.3f} ms")
        print(f"{'backend':>13} {'tok/s':>9} {'step ms':>8} {'vs transformers':>15}")
        hf = next((r["tok_s"] for r in rows if r["backend"] == "transformers"), None)
        for r in rows:
            ratio = f"{r['tok_s'] / hf:.1f}x" if hf else "-"
            print(f"{r['backend']:>13} {r['tok_s']:>9.0f} {r.get('median_step_ms', float('nan')):>8.2f} {ratio:>15}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
