"""Custom ops "triton": fused residual-add + RMSNorm, RMSNorm, SiLU-and-mul, rotary, rotary + KV write,
greedy sampling (argmax and its log-probability in one kernel), the MoE router (softmax, top-k and
renormalisation in one kernel).

This module is the plugin's entry point and registers implementations only; triton is imported
on the first launch. On CUDA the ops rank at priority 50: above native (0), below FlashInfer's
ops (100), so where FlashInfer is installed only the ops it lacks (`rotary_kv_write`) come from here.
They rose from -10 (named only) once the GPU tests of the ops (today `python -m bench.run ops`) had
passed on an H200 (2026-12-04: 169 GPU tests; 2-20x faster than native in a graph, see
docs/performance.md). `greedy_sample` ranks at -10 on CUDA (named only: `--custom-ops
greedy_sample=triton`): its GPU tests pass (H100, 2026-12-07), but on the GPU machine's host one
Triton launch from Python cost more than the three torch launches it replaces (`bench.host_path
--real-model`: the sampling phase 84 -> 145 us a request) and its device-side gain is unmeasured; it
rises once `bench.decode` shows one. `moe_route` rose from -10 to 50 once its GPU tests passed and the
bs-1 decode step of a Qwen3-30B-A3B-shaped model ran 5.41 -> 4.67 ms with it (H100, 2026-12-07,
`python -m bench.run moe-route-ab`; docs/performance.md). On CPU they run only under TRITON_INTERPRET=1 and only when asked for
(`--custom-ops rms_norm=triton`): their CPU priority is below native's, so nothing picks them by
itself. Every op is a torch.library op, declared compile-safe: under `--enable-torch-compile` it
stays one opaque call in the compiled graph instead of being replaced by native.
"""

from __future__ import annotations

import importlib.util
import os

from backplane import CustomOpImpl, hookimpl

NAME = "triton"
CUDA_PRIORITY = 50  # above native (0), below FlashInfer (100)
CPU_PRIORITY = -50  # below native (0): on CPU only an explicit --custom-ops picks it
NAMED_ONLY = -10  # below native on CUDA too: runs only when --custom-ops names it
CUDA_PRIORITIES = {"greedy_sample": NAMED_ONLY}  # ops whose CUDA rank is not CUDA_PRIORITY (see the docstring)
INSTALL_HINT = "pip install triton"


def _triton_missing() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return f"triton is not installed ({INSTALL_HINT})"
    return None


def _available_cuda() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "CUDA is not available on this machine"
    return _triton_missing()


def _available_cpu() -> str | None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "the Triton kernels run on CPU only under TRITON_INTERPRET=1 (for tests; slow)"
    return _triton_missing()


@hookimpl
def backplane_register_custom_ops(register):
    from backplane.plugins.ops_triton.ops import TRITON_OPS

    for op, fn in TRITON_OPS.items():
        register(CustomOpImpl(op=op, platform="cuda", fn=fn, name=NAME, priority=CUDA_PRIORITIES.get(op, CUDA_PRIORITY),
                              available=_available_cuda, compile_safe=True))
        register(CustomOpImpl(op=op, platform="cpu", fn=fn, name=NAME, priority=CPU_PRIORITY,
                              available=_available_cpu, compile_safe=True))
