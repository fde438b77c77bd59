"""The "triton" attention backend plugin: registration only (the kernels load in the factory)."""

from __future__ import annotations

import importlib.util
import os

from backplane import hookimpl
from backplane import AttentionBackendSpec

from .options import TritonAttentionOptions

HEAD_DIMS = (32, 64, 80, 96, 128, 256)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _available() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    import torch

    if torch.cuda.is_available() or _interpreting():
        return None
    return "no CUDA device (set TRITON_INTERPRET=1 to run the kernels in the Triton interpreter on CPU)"


def _make(ctx):
    from .backend import TritonAttnBackend

    return TritonAttnBackend(ctx)


@hookimpl
def backplane_register_attention_backends(register):
    # NOTE: the interpreter runs on CPU but its tl.dot on bfloat16 is wrong, so CPU gets fp32/fp16 only.
    interpreting = _interpreting()
    register(
        AttentionBackendSpec(
            name="triton",
            factory=_make,
            description="Triton split-KV decode and prefix-aware extend kernels over the page-size-1 pool",
            platforms=("cpu", "cuda") if interpreting else ("cuda",),
            dtypes=("float32", "float16") if interpreting else ("float32", "float16", "bfloat16"),
            head_dims=HEAD_DIMS,
            kv_cache_dtypes=("fp8_e4m3",),
            modes=("extend", "decode", "target_verify", "draft_extend"),
            graph_modes=("extend", "decode", "target_verify", "draft_extend"),
            custom_mask=True,
            sliding_window=True,
            logit_softcap=True,
            seq_len_fill_value=1,
            # Interpreted kernels are for tests: `auto` must never prefer them to torch_native.
            priority=-50 if interpreting else 50,
            available=_available,
            install_hint="pip install triton",
        )
    )


@hookimpl
def backplane_register_settings(register):
    register("triton-attention", TritonAttentionOptions)
