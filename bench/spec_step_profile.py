"""Where a speculative step's time goes on the GPU: kernels by device time, per step.

Builds the EAGLE engine of bench/spec.py (preset llama-3.2-1b, dummy bf16 weights, chain of 7
steps, 8 draft tokens, graphs on), forces full acceptance, and profiles a generation with CUDA
and CPU activities. Prints the kernels by device time per step (kernels inside graph replays
included), the sum of kernel time per step and the wall time per step: their difference is the
time the GPU waits for the host.

    python bench/spec_step_profile.py [--backend triton] [--tokens 128] [--top 25]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from spec import COMMON, NUM_DRAFT, STEPS, accept_every_draft, random_head  # noqa: E402

from backplane import Engine, SamplingParams  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="triton")
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--top", type=int, default=25)
    ns = p.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from backplane.models.presets import get_preset

    config = get_preset(ns.model)
    common = dict(COMMON, device="cuda", dtype="bfloat16")
    with tempfile.TemporaryDirectory() as folder:
        head = random_head(Path(folder), config, torch.bfloat16)
        engine = Engine(ns.model, attention_backend=ns.backend, speculative_algorithm="eagle",
                        speculative_draft_model=head, speculative_num_steps=STEPS, speculative_eagle_topk=1,
                        speculative_num_draft_tokens=NUM_DRAFT, **common)
    prompt = list(range(3, 131))
    params = SamplingParams(max_new_tokens=ns.tokens, temperature=0, ignore_eos=True)
    undo = accept_every_draft()
    try:
        engine.generate(input_ids=[prompt], sampling_params=params)  # warm up
        steps_before = engine.spec_worker.stats.steps
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            engine.generate(input_ids=[prompt], sampling_params=params)
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
    finally:
        undo()
    steps = engine.spec_worker.stats.steps - steps_before
    rows = [(e.key, e.device_time_total, e.count) for e in prof.key_averages()
            if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    rows.sort(key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    print(f"{steps} speculative steps (+ prefill): wall {wall * 1e3 / steps:.3f} ms a step, "
          f"kernels {total / 1e3 / steps:.3f} ms a step")
    print(f"{'us/step':>9} {'launches/step':>13}  kernel")
    for key, t, count in rows[: ns.top]:
        print(f"{t / steps:9.1f} {count / steps:13.1f}  {key[:90]}")
    cpu = [(e.key, e.cpu_time_total, e.count) for e in prof.key_averages() if e.device_type.name == "CPU"]
    cpu.sort(key=lambda r: -r[1])
    print("host ops by total CPU time (us/step, calls/step):")
    for key, t, count in cpu[: ns.top]:
        print(f"{t / steps:9.1f} {count / steps:9.1f}  {key[:90]}")


if __name__ == "__main__":
    main()
