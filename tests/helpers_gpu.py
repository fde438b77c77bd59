"""Shared test helper: the marks of a GPU test module whose Triton kernels must run compiled."""

from __future__ import annotations

import os

import pytest
import torch


def interpreted(kernel) -> bool:
    """Whether Triton `kernel` runs in the interpreter: a kernel's mode is fixed when it is defined, so
    if a CPU test module set TRITON_INTERPRET=1 before it was first imported, it stays interpreted."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction) or os.environ.get("TRITON_INTERPRET") == "1"


def compiled_triton_marks(kernel, run: str) -> list:
    """pytestmark of such a module: `gpu`, skipped without CUDA, and skipped (saying `run`, the command
    that runs it alone) where `kernel` is interpreted."""
    return [
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        pytest.mark.skipif(interpreted(kernel), reason=f"kernels defined under TRITON_INTERPRET=1; run `{run}`"),
    ]
