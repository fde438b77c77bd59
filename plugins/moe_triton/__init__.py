"""MoE backend "triton": tokens sorted by expert in block-aligned runs, then two grouped-GEMM Triton
kernels (gate/up fused with SiLU-and-mul; down with the router weight applied) and the k-way sum.

FP8 experts (--quantization fp8: block-wise or per-channel checkpoints, or online) run as FP8 GEMMs
with activations quantized per token or per 1 x 128 group.

Registration only: triton is imported when the backend is built, never when this module loads.
With TRITON_INTERPRET=1 the kernels also run on CPU tensors (slowly; tests call the backend directly).
"""

from __future__ import annotations

from backplane import MoeBackendSpec, hookimpl

MAX_EXPERTS = 1024  # align.MAX_EXPERTS (not imported here: that module imports triton)


def _available() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"triton is not importable ({exc})"
    import torch

    return None if torch.cuda.is_available() else "no CUDA device"


def _make(ctx):
    from backplane.plugins.moe_triton.backend import TritonMoeBackend

    return TritonMoeBackend(ctx)


@hookimpl
def backplane_register_moe_backends(register):
    register(
        MoeBackendSpec(
            name="triton",
            factory=_make,
            description="Triton grouped GEMMs over expert-sorted, block-aligned tokens; gate/up fused with SiLU-and-mul",
            platforms=("cuda",),
            dtypes=("bfloat16", "float16", "float32"),
            max_experts=MAX_EXPERTS,
            supports_graph=True,  # fixed-size workspaces and grids: no host sync, no routing-sized allocation
            supports_compile=True,  # through the core's opaque op
            quant_methods=("fp8",),  # FP8 experts: per-channel or block scales (backend.QUANT_METHODS)
            priority=10,
            available=_available,
            install_hint="pip install triton",
        )
    )


@hookimpl
def backplane_register_settings(register):
    from backplane.plugins.moe_triton.options import TritonMoeOptions

    register("triton-moe", TritonMoeOptions)
