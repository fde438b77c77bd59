"""Attention-backend conformance: any registered backend against the torch_native reference.

In a plugin's test suite:

    from backplane.testing import attention_conformance
    test_mine = attention_conformance.make_suite("mine")

Each case builds real KV pools with random data at random slots, runs the backend and the
reference on the same batch, and compares outputs and the K/V written into the pool. Cases the
backend does not declare (a mode, a head dim, a window, a soft-cap, a custom mask) are left out.
`make_graph_suite` holds the graph cases: decode, DRAFT_EXTEND and compile with CUDA, and EXTEND
graphs (full or piecewise, as declared) on CUDA and, through `rerun_capture`, on CPU.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch

from backplane.contracts.attention import AttentionBackend
from backplane.contracts.batch import ForwardBatch
from backplane.testing.attention_harness import TOLERANCE, Case, Harness  # noqa: F401  (re-exported)

def base_cases(small: bool) -> list[Case]:
    """Odd sizes; `small` keeps lengths short (CPU, the Triton interpreter)."""
    long = 67 if small else 1000
    return [
        Case("extend-no-prefix", "extend", (0, 0, 0), (1, 7, 29)),
        Case("extend-with-prefix", "extend", (5, 0, 17), (3, 9, 1)),
        Case("extend-long", "extend", (long - 20,), (20,)),
        Case("decode-odd-batch", "decode", (0, 8, 32, 63, 129), (1, 1, 1, 1, 1)),
        Case("decode-long", "decode", (long,), (1,)),
        Case("decode-batch-17", "decode", tuple(range(1, 35, 2)), (1,) * 17),
        Case("gqa-1", "decode", (4, 30, 9), (1, 1, 1), num_heads=4, num_kv_heads=4),
        Case("gqa-8", "extend", (6, 0), (5, 11), num_heads=8, num_kv_heads=1),
        Case("head-dim-128", "extend", (3, 12), (4, 2), num_heads=4, num_kv_heads=1, head_dim=128),
        Case("head-dim-128-decode", "decode", (13, 40), (1, 1), num_heads=4, num_kv_heads=1, head_dim=128),
        Case("verify-tree-mask", "target_verify", (6, 11, 1), (4, 4, 4), tree_mask=True),
        Case("draft-extend", "draft_extend", (9, 3), (2, 2)),
        Case("sliding-window-extend", "extend", (20, 3), (9, 14), window=8),
        Case("sliding-window-decode", "decode", (30, 5, 70), (1, 1, 1), window=16),
        Case("softcap-extend", "extend", (7, 0), (6, 13), softcap=5.0),
        Case("softcap-decode", "decode", (25, 2), (1, 1), softcap=5.0),
    ]


def applicable(spec, case: Case, device: str) -> str | None:
    """Why `case` does not apply to the backend described by `spec` (None when it does)."""
    if device not in spec.platforms:
        return f"backend does not run on {device}"
    if case.mode not in spec.modes:
        return f"mode {case.mode} not declared"
    if spec.head_dims is not None and case.head_dim not in spec.head_dims:
        return f"head dim {case.head_dim} not declared"
    for needed, flag in ((case.window, "sliding_window"), (case.softcap, "logit_softcap"),
                         (case.tree_mask, "custom_mask")):
        if needed and not getattr(spec, flag):
            return f"{flag} not declared"
    return None


def run_backend(backend: AttentionBackend, harness: Harness, batch: ForwardBatch, qkv) -> torch.Tensor:
    batch = copy.copy(batch)  # a backend may set fields on its batch; the reference gets a clean one
    backend.init_forward_metadata(batch)
    return backend.forward(*qkv, harness.layer(), batch)


def check_case(spec, case: Case, device: str, dtype: torch.dtype, seed: int = 0, options=None) -> None:
    """Run `case` through the backend of `spec` (built with the plugin `options`, None for its
    defaults) and through torch_native; assert they agree."""
    from backplane.attention.torch_native import TorchNativeAttnBackend

    harness = Harness(case, dtype, device, seed)
    batch = harness.batch()
    n = batch.num_tokens
    qkv = (harness.randn(n, case.num_heads, case.head_dim), harness.randn(n, case.num_kv_heads, case.head_dim),
           harness.randn(n, case.num_kv_heads, case.head_dim))
    k_before = [b.clone() for b in harness.kv_pool.get_kv_buffer(0)]
    out = run_backend(spec.factory(harness.context(options)), harness, batch, qkv)
    written = [b.clone() for b in harness.kv_pool.get_kv_buffer(0)]
    for buf, before in zip(harness.kv_pool.get_kv_buffer(0), k_before):
        buf.copy_(before)
    expected = run_backend(TorchNativeAttnBackend(harness.context()), harness, batch, qkv)
    tol = TOLERANCE[dtype]
    assert out.shape == expected.shape, f"{case}: output shape {tuple(out.shape)}, expected {tuple(expected.shape)}"
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol, msg=lambda m: f"{case}: {m}")
    for got, want, name in zip(written, harness.kv_pool.get_kv_buffer(0), ("K", "V")):
        assert torch.equal(got, want), f"{case}: {name} written into the pool differs from the reference"


def default_dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32


def make_suite(backend_name: str, device: str | None = None, dtype: torch.dtype | None = None, options=None):
    """A pytest test function parametrized over every conformance case.

    options: the backend's plugin option object (its settings group model) to build it with, so a
    backend can be checked under each of its settings; None for its defaults.
    """
    import pytest

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cases = base_cases(small=device == "cpu")

    @pytest.mark.parametrize("case", cases, ids=str)
    def test_attention_conformance(case):
        spec = _spec(backend_name)
        reason = spec.available() or applicable(spec, case, device)
        if reason:
            pytest.skip(f"{backend_name}: {reason}")
        check_case(spec, case, device, dtype or default_dtype(device), options=options)

    return test_attention_conformance


def _spec(backend_name: str):
    from backplane.plugin.manager import load_plugins

    specs = load_plugins().registry.specs("attention")
    if backend_name not in specs:
        raise LookupError(f"attention backend {backend_name!r} is not registered; registered: {', '.join(sorted(specs))}")
    return specs[backend_name]


__all__ = ["Case", "Harness", "base_cases", "check_case", "make_suite", "make_graph_suite", "applicable", "replace"]


# Extend graph cases: (case name, layer window, layer soft-cap, the spec flag the case needs).
EXTEND_GRAPH_CASES = {"extend": (0, 0.0, None), "extend-sliding-window": (8, 0.0, "sliding_window"),
                      "extend-softcap": (0, 5.0, "logit_softcap")}


def make_graph_suite(backend_name: str, dtype: torch.dtype | None = None, device: str | None = None):
    """A pytest test over the graph cases, each selected by what the backend declares.

    CUDA only (marked `gpu`): decode captured at sizes 1, 2, 4, 8, 16 and replayed over random
    padded batches for many steps equals torch_native; so does a DRAFT_EXTEND of 8 tokens a
    request when the backend declares draft_extend graphs; and ("compile") decode through the
    core's opaque attention op inside a torch.compile region, as --enable-torch-compile runs it.

    On CUDA and on CPU (not marked): "extend", "extend-sliding-window", "extend-softcap" when the
    backend declares "extend" in graph_modes (full capture) or piecewise_graph_modes (and the
    window / soft-cap): random ragged EXTEND batches padded into the runner's (request slots,
    token bucket) keys, each key captured once and replayed over many batches (see
    `graph_conformance.check_extend_graph_replay`); on CPU the capture is `rerun_capture`.
    device: "cuda" when available, else "cpu"; dtype: bf16 on cuda, fp32 on cpu.
    """
    import pytest

    gpu = pytest.mark.gpu
    params = [pytest.param(m, marks=gpu) for m in ("decode", "draft_extend", "compile")] + list(EXTEND_GRAPH_CASES)

    @pytest.mark.parametrize("mode", params)
    def test_attention_graph_conformance(mode):
        spec = _spec(backend_name)
        if mode in EXTEND_GRAPH_CASES:
            return _extend_graph_case(spec, backend_name, mode, device, dtype)
        if not torch.cuda.is_available():
            pytest.skip("graph replay needs CUDA")
        if spec.available() or (mode != "compile" and mode not in spec.graph_modes):
            pytest.skip(f"{backend_name}: {spec.available() or f'declares no {mode} graphs'}")
        from backplane.testing.graph_conformance import check_compiled_decode, check_graph_replay

        if mode == "compile":
            check_compiled_decode(spec, dtype or torch.bfloat16)
        else:
            check_graph_replay(spec, dtype or torch.bfloat16, tokens=1 if mode == "decode" else 8)

    return test_attention_graph_conformance


def _extend_graph_case(spec, backend_name: str, case: str, device: str | None, dtype: torch.dtype | None) -> None:
    import pytest

    from backplane.testing.graph_conformance import check_extend_graph_replay, extend_graph_kind

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or default_dtype(device)
    window, softcap, flag = EXTEND_GRAPH_CASES[case]
    reason = (spec.available() or (device not in spec.platforms and f"backend does not run on {device}")
              or (str(dtype).removeprefix("torch.") not in spec.dtypes and f"dtype {dtype} not declared")
              or (spec.head_dims is not None and 64 not in spec.head_dims and "head dim 64 not declared")
              or (extend_graph_kind(spec) is None and "declares no extend graphs (full or piecewise)")
              or (flag and not getattr(spec, flag) and f"{flag} not declared"))
    if reason:
        pytest.skip(f"{backend_name}: {reason}")
    if device == "cuda":  # the runner's default ladders, shortened: buckets 8..256, 1..8 requests
        check_extend_graph_replay(spec, dtype, device, window=4 * window, softcap=softcap)
    else:  # the interpreter is slow: buckets 8, 16, 32 of 1, 2, 4 requests
        check_extend_graph_replay(spec, dtype, device, max_tokens=32, max_requests=4, replays_per_key=2,
                                  window=window, softcap=softcap, num_heads=4)
