"""backplane's benchmarks, run from the repository root as `python -m bench.<name>` (`--help` on each).

Library: timing (device medians, the card's copy bandwidth, profiler summaries), report (result
files named by card, commit and date; ratios; tables), workload (prompts, request shapes, dummy
adapters), peer (the torch.compile Llama loop), steps (what one engine step costs).
Benchmarks: decode, prefill, ttft (time to first token, extend graphs on and off), e2e, serving, lora,
spec; the kernels: attention, lora_kernels, ops.
GPU groups of tests and benchmarks: `python -m bench.run GROUP` (bench/run.py lists them).
"""
