"""A custom op implementation checked once, at startup, against the native op on a small input.

An implementation that `auto` picks and that raises, or returns another structure, shape or dtype,
or values far from the native op's, would otherwise fail (or corrupt) every request. `probe_problem`
runs it once next to the native op on fresh random inputs, on the platform's device, and returns
the problem in one line (with the implementation's file:line), or None when it matches.
"""

from __future__ import annotations

from typing import Any

import torch

from backplane.plugin.failures import def_location, failure_location, one_line, with_location

TOKENS, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, SLOTS, VOCAB, EXPERTS, TOP_K = 3, 2, 1, 64, 64, 8, 1000, 64, 4
TOLERANCE = {torch.float32: 1e-3, torch.float16: 2e-2}


def probe_inputs(op: str, device: torch.device, dtype: torch.dtype) -> tuple:
    """Arguments for one call of `op` (signatures of backplane.ops.native), fresh random values."""
    def rand(*shape: int, kind: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=kind)

    positions = torch.tensor([0, 5, 9], device=device)
    cos_sin = rand(16, HEAD_DIM, kind=torch.float32)
    q, k, v = rand(TOKENS, HEADS, HEAD_DIM), rand(TOKENS, KV_HEADS, HEAD_DIM), rand(TOKENS, KV_HEADS, HEAD_DIM)
    return {
        "rms_norm": lambda: (rand(TOKENS, HIDDEN), rand(HIDDEN), 1e-6),
        "fused_add_rms_norm": lambda: (rand(TOKENS, HIDDEN), rand(TOKENS, HIDDEN), rand(HIDDEN), 1e-6),
        "silu_and_mul": lambda: (rand(TOKENS, 2 * HIDDEN),),
        "gelu_and_mul": lambda: (rand(TOKENS, 2 * HIDDEN),),
        "gelu": lambda: (rand(TOKENS, HIDDEN),),
        "quick_gelu": lambda: (rand(TOKENS, HIDDEN),),
        "rotary_embedding": lambda: (positions, q, k, cos_sin, True),
        "rotary_kv_write": lambda: (positions, q, k, v, cos_sin, True, torch.zeros(SLOTS, KV_HEADS, HEAD_DIM, device=device,
                                    dtype=dtype), torch.zeros(SLOTS, KV_HEADS, HEAD_DIM, device=device, dtype=dtype),
                                    torch.tensor([1, 4, 6], device=device)),
        "greedy_sample": lambda: (rand(TOKENS, VOCAB, kind=torch.float32),),  # the sampler's logits are fp32
        # NOTE: distinct logits per row (a random order of multiples of 1/8): the probe does not judge how ties go
        "moe_route": lambda: (torch.stack([torch.randperm(EXPERTS, device=device) for _ in range(TOKENS)]).to(dtype) / 8,
                              TOP_K, True),
    }[op]()


def probe_problem(op: str, impl: Any, platform: str) -> str | None:
    """Why `impl` (a CustomOpImpl) does not behave like the native `op` on a small probe, or None.
    Native implementations and platforms without a device here are not probed."""
    from backplane.ops.native import NATIVE_OPS

    if impl.fn is NATIVE_OPS[op] or (platform == "cuda" and not torch.cuda.is_available()):
        return None
    device = torch.device(platform)
    dtype = torch.float16 if platform == "cuda" else torch.float32
    args = probe_inputs(op, device, dtype)
    expected = _observed(op, NATIVE_OPS[op], _clone(args))
    where = f"implementation {impl.name!r} of custom op {op!r}"
    try:
        got = _observed(op, impl.fn, _clone(args))
    except Exception as exc:  # noqa: BLE001 - the plugin's op may fail in any way
        return with_location(f"{where} raised {one_line(exc)} on a probe input",
                             failure_location(exc, getattr(impl.fn, "__module__", None)))
    mismatch = _mismatch(expected, got, TOLERANCE[dtype])
    return with_location(f"{where} {mismatch} on a probe input", def_location(impl.fn)) if mismatch else None


def _observed(op: str, fn: Any, args: tuple) -> tuple:
    """What a call shows: its results (and the caches `rotary_kv_write` must write)."""
    out = fn(*args)
    out = out if isinstance(out, tuple) else (out,)
    return (*out, args[6], args[7]) if op == "rotary_kv_write" else out


def _clone(args: tuple) -> tuple:
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def _mismatch(expected: tuple, got: tuple, tolerance: float) -> str | None:
    if len(got) != len(expected) or not all(isinstance(t, torch.Tensor) for t in got):
        return f"returned {_describe(got)}, expected {_describe(expected)} like the native op"
    for i, (e, g) in enumerate(zip(expected, got)):
        if g.shape != e.shape or g.dtype != e.dtype:
            return f"returned {_describe(got)}, expected {_describe(expected)} like the native op"
        if not torch.allclose(g.float(), e.float(), atol=tolerance, rtol=tolerance):
            error = (g.float() - e.float()).abs().max().item()
            return f"output {i} differs from the native op by up to {error:.3g} (tolerance {tolerance})"
    return None


def _describe(values: tuple) -> str:
    return ", ".join(f"{list(v.shape)} {str(v.dtype).removeprefix('torch.')}" if isinstance(v, torch.Tensor)
                     else type(v).__name__ for v in values)
