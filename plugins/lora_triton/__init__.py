"""LoRA backend "triton": segmented-GEMM Triton kernels (shrink, expand, fused q/k/v and gate/up).

Registration only: triton is imported when the backend is built, never when this module loads.
With TRITON_INTERPRET=1 the kernels also run on CPU tensors (slowly; for tests).
"""

from __future__ import annotations

import os

from backplane import hookimpl
from backplane import LoraBackendSpec


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _available() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"triton is not importable ({exc})"
    import torch

    if torch.cuda.is_available() or _interpreted():
        return None
    return "no CUDA device (set TRITON_INTERPRET=1 to run the kernels on CPU, for tests only)"


def _make(ctx):
    from backplane.plugins.lora_triton.backend import TritonLoraBackend

    return TritonLoraBackend(ctx)


@hookimpl
def backplane_register_lora_backends(register):
    register(
        LoraBackendSpec(
            name="triton",
            factory=_make,
            description="Triton segmented-GEMM kernels, slot-grouped tiles, fused q/k/v and gate/up",
            platforms=("cpu", "cuda") if _interpreted() else ("cuda",),
            # NOTE: the interpreter's tl.dot is wrong on bfloat16 operands
            dtypes=("float32", "float16") if _interpreted() else ("float32", "float16", "bfloat16"),
            supports_graph=True,
            # extend too: tile tables on the device, a grid sized for the bucket's worst case (plan.py)
            graph_modes=("decode", "target_verify", "extend"),
            # Interpreted kernels are for tests: `auto` must never prefer them to torch_native.
            priority=-50 if _interpreted() else 50,
            available=_available,
            install_hint="pip install triton",
        )
    )


@hookimpl
def backplane_register_settings(register):
    from backplane.plugins.lora_triton.options import TritonLoraOptions

    register("triton-lora", TritonLoraOptions)
