"""The FlashInfer plugin: attention backend "flashinfer" and FlashInfer custom ops (CUDA only).

This module is the plugin's entry point. It registers specs only: flashinfer (about 20 s to
import) and CUDA are touched when a backend is built or an op first runs, never here.
"""

from __future__ import annotations

import importlib.util
import sys

from backplane import hookimpl
from backplane.plugins.attention_flashinfer.options import FlashInferOptions
from backplane import ALL_MODES, AttentionBackendSpec, CustomOpImpl

INSTALL_HINT = "pip install 'backplane-llm[flashinfer]'"
# Ops with a FlashInfer kernel; gelu and quick_gelu stay native.
FLASHINFER_OPS = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "gelu_and_mul", "rotary_embedding")


def _available() -> str | None:
    """None when CUDA is usable and flashinfer is installed, else the reason (imports neither)."""
    import torch

    if not torch.cuda.is_available():
        return "CUDA is not available on this machine"
    if "flashinfer" not in sys.modules and importlib.util.find_spec("flashinfer") is None:
        return f"flashinfer is not installed ({INSTALL_HINT})"
    return None


def _make(ctx):
    from backplane.plugins.attention_flashinfer.backend import FlashInferAttnBackend

    return FlashInferAttnBackend(ctx)


@hookimpl
def backplane_register_attention_backends(register):
    register(
        AttentionBackendSpec(
            name="flashinfer",
            factory=_make,
            description="FlashInfer paged attention (plan once per batch, run per layer)",
            platforms=("cuda",),
            dtypes=("float16", "bfloat16"),
            head_dims=(64, 128, 256),
            kv_cache_dtypes=("fp8_e4m3",),
            modes=ALL_MODES,
            graph_modes=("extend", "decode", "target_verify", "draft_extend"),
            custom_mask=True,
            sliding_window=True,
            logit_softcap=True,
            seq_len_fill_value=1,
            priority=100,
            available=_available,
            install_hint=INSTALL_HINT,
        )
    )


@hookimpl
def backplane_register_custom_ops(register):
    from backplane.plugins.attention_flashinfer import ops

    for op in FLASHINFER_OPS:
        fn = getattr(ops, op)
        register(CustomOpImpl(op=op, platform="cuda", fn=fn, name="flashinfer", priority=100, available=_available))


@hookimpl
def backplane_register_settings(register):
    register("flashinfer", FlashInferOptions)
