"""LoRA-backend conformance: any registered LoRA backend against a plain per-segment reference.

In a plugin's test suite:

    from backplane.testing import lora_conformance
    test_mine = lora_conformance.make_suite("mine")

Each case is one projection the way the core calls it (core/lora/layers.py): either `apply_lora`
(shrink and expand in one call, fused cases: what every layer without a tensor-parallel input split
runs), or the stacked shrink `lora_a`, then the fused q/k/v expand, the fused gate/up expand, or the
plain `lora_b` (split cases), or `expand_folded` after the base GEMM over the weight with every
slot's A under it (folded cases: the decode path of a backend with `folds_shrink`), over a batch of
segments that mixes adapters of different ranks (8 to 64, and scalings) with base-only segments
(slot 0, rank 0). Weights follow the core's layout: A zero beyond each slot's rank, B random there
(a backend must ignore it). Rows not covered by a segment must stay untouched.

Graph cases capture the products at a padded batch size with every segment on slot 0, then refresh
the batch info in place with two different real batches (padding on slot 0) and replay: inside a
real CUDA graph on CUDA, and as the same capture/replay metadata calls run eagerly elsewhere.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import torch

from backplane.contracts.lora import LoraBackendContext
from backplane.contracts.lora_batch import LoraBatchInfo

TOLERANCE = {torch.float32: 2e-4, torch.float16: 2e-2, torch.bfloat16: 4e-2}
R_MAX = 16
RANKS = (0, 4, 16, 8, 1)  # per slot; slot 0 is the base-only slot
RANKS_64 = (0, 8, 64, 33, 16)  # the same slots at R_max 64
HIDDEN, N_Q, N_KV, N_INTER = 72, 80, 40, 104  # not multiples of any block size
NUM_UNCOVERED = 3  # extra rows after the batch's tokens in eager cases


@dataclass(frozen=True)
class Case:
    """One check. projection: "qkv" (3 slices), "gate_up" (2) or "single" (o/down-like, 1);
    fused: call `apply_lora` instead of the separate products; folded: `expand_folded` on the output
    of x @ [W; A]^T; ranks: per slot, at most r_max."""

    name: str
    seg_lens: tuple[int, ...]
    slots: tuple[int, ...]
    projection: str
    graph: bool = False
    fused: bool = False
    folded: bool = False
    r_max: int = R_MAX
    ranks: tuple[int, ...] = RANKS

    def __str__(self) -> str:
        return self.name


def base_cases(small: bool) -> list[Case]:
    """Mixed adapters and ranks, base-only segments, repeated slots, odd lengths; `small` keeps
    lengths short (CPU, the Triton interpreter)."""
    long = 67 if small else 700
    cycle = tuple(i % len(RANKS) for i in range(17))
    cases = [
        Case("mixed-qkv", (3, 1, 17, 5, 2), (1, 0, 2, 3, 1), "qkv"),
        Case("mixed-gate-up", (2, 9, 1, 4), (4, 2, 0, 3), "gate_up"),
        Case("mixed-single", (5, 1, 1, 8, 3), (3, 3, 0, 1, 2), "single"),
        Case("base-only", (4, 7), (0, 0), "qkv"),
        Case("one-adapter-long", (long,), (2,), "gate_up"),
        Case("decode-batch-17", (1,) * 17, cycle, "qkv"),
        Case("graph-decode-qkv", (1,) * 5, (2, 0, 4, 2, 1), "qkv", graph=True),
        Case("graph-decode-gate-up", (1,) * 11, cycle[:11], "gate_up", graph=True),
        Case("graph-verify-single", (4, 4, 4), (1, 0, 3), "single", graph=True),
        # apply_lora: decode batches of 1 and 17 (fused kernels where a backend has them), ranks to 64
        Case("fused-decode-1", (1,), (2,), "qkv", fused=True),
        Case("fused-decode-17", (1,) * 17, cycle, "gate_up", fused=True),
        Case("fused-decode-17-rank-64", (1,) * 17, cycle, "qkv", fused=True, r_max=64, ranks=RANKS_64),
        Case("fused-mixed-single-rank-64", (5, 1, 1, 8, 3), (3, 3, 0, 1, 2), "single", fused=True, r_max=64,
             ranks=RANKS_64),
        Case("fused-base-only", (1,) * 4, (0,) * 4, "qkv", fused=True),
        Case("fused-prefill-long", (long, 3), (2, 1), "gate_up", fused=True),
        Case("graph-fused-decode-qkv", (1,) * 5, (2, 0, 4, 2, 1), "qkv", graph=True, fused=True),
        Case("graph-fused-decode-gate-up-rank-64", (1,) * 11, cycle[:11], "gate_up", graph=True, fused=True,
             r_max=64, ranks=RANKS_64),
        Case("graph-fused-verify-single", (4, 4, 4), (1, 0, 3), "single", graph=True, fused=True),
    ]
    # expand_folded on the same batches as apply_lora's, but for the long prefill: the core folds
    # passes of up to 64 tokens (decode batches, verify and short prefill chunks) only
    folded = [replace(c, name=c.name.replace("fused", "folded"), fused=False, folded=True)
              for c in cases if c.fused and sum(c.seg_lens) <= 64]
    return cases + folded


def slice_sizes(projection: str) -> tuple[int, list[int]]:
    """(in_features, output width of each slice) of a projection kind."""
    return {"qkv": (HIDDEN, [N_Q, N_KV, N_KV]), "gate_up": (HIDDEN, [N_INTER, N_INTER]),
            "single": (N_INTER, [HIDDEN])}[projection]


class Problem:
    """Random weights in the core's stacked layout, scalings, activations and base outputs."""

    def __init__(self, case: Case, dtype: torch.dtype, device: str, seed: int):
        self.case, self.dtype, self.device = case, dtype, torch.device(device)
        self.gen = torch.Generator().manual_seed(seed)
        self.in_features, sizes = slice_sizes(case.projection)
        self.offsets = [sum(sizes[:j]) for j in range(len(sizes) + 1)]
        self.r_max, self.ranks = case.r_max, case.ranks
        num_slices, num_slots, r_max = len(sizes), len(self.ranks), self.r_max
        a = self.randn(num_slots, num_slices * r_max, self.in_features) / self.in_features**0.5
        rows = torch.arange(num_slices * r_max) % r_max
        a *= (rows[None, :] < torch.tensor(self.ranks)[:, None]).float()[:, :, None]  # zero beyond the rank
        b = self.randn(num_slots, self.offsets[-1], r_max) / r_max**0.5  # random beyond the rank
        b[0] = 0
        self.a, self.b = self.to_device(a), self.to_device(b)
        self.scalings = [0.0] + [0.25 + 1.75 * float(torch.rand(1, generator=self.gen)) for _ in self.ranks[1:]]

    def randn(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, self.dtype)

    def inputs(self, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [num_rows, in_features] and base output [num_rows, N]."""
        x = self.randn(num_rows, self.in_features)
        return self.to_device(x), self.to_device(self.randn(num_rows, self.offsets[-1]))

    def context(self, max_bs: int, max_tokens: int) -> LoraBackendContext:
        return LoraBackendContext(device=self.device, dtype=self.dtype, max_loras_per_batch=len(self.ranks) - 1,
                                  max_lora_rank=self.r_max, max_bs=max_bs, max_num_tokens=max_tokens)

    def info(self, seg_lens, slots, max_segments: int) -> LoraBatchInfo:
        return LoraBatchInfo.from_segments(list(seg_lens), list(slots), list(self.ranks), self.scalings,
                                           self.device, max_segments)

    def run(self, backend, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The core's call sequence for this projection kind; adds the LoRA delta to `out` in place.
        A folded case stands `out` in for the base columns of the GEMM over [W; A] (every slot's A
        under the weight, slot-major, as LoraLinear keeps them) and lets the backend write base +
        delta back into it."""
        if self.case.folded:
            shrink = x.float() @ self.a.reshape(-1, self.in_features).float().T  # every slot's x A^T
            y = torch.cat([out, shrink.to(out.dtype)], dim=1)
            return backend.expand_folded(y, self.offsets[-1], self.b, self.offsets, out)
        if self.case.fused:
            return backend.apply_lora(x, self.a, self.b, self.offsets, out)
        shrunk = backend.lora_a(x, self.a, len(self.offsets) - 1)
        if self.case.projection == "qkv":
            return backend.qkv_lora_b(shrunk, self.b, self.offsets, out)
        if self.case.projection == "gate_up":
            return backend.gate_up_lora_b(shrunk, self.b, out)
        return backend.lora_b(shrunk, self.b, out)

    def reference(self, x, base, seg_lens, slots) -> torch.Tensor:
        """base + scaling * (x A^T)[:rank] B[:, :rank]^T per segment and slice, in float64."""
        out = base.double().cpu().clone()
        x64, a64, b64 = x.double().cpu(), self.a.double().cpu(), self.b.double().cpu()
        start = 0
        for length, slot in zip(seg_lens, slots):
            rows, rank = slice(start, start + length), self.ranks[slot]
            for j, (lo, hi) in enumerate(zip(self.offsets, self.offsets[1:])):
                a_j = a64[slot, j * self.r_max : j * self.r_max + rank]  # [rank, K]
                out[rows, lo:hi] += self.scalings[slot] * (x64[rows] @ a_j.T) @ b64[slot, lo:hi, :rank].T
            start += length
        return out


def assert_close(case: Case, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.double().cpu(), want, atol=tol, rtol=tol, msg=lambda m: f"{case} ({what}): {m}")


def check_eager(spec, case: Case, device: str, dtype: torch.dtype, seed: int = 0) -> None:
    problem = Problem(case, dtype, device, seed)
    num_tokens = sum(case.seg_lens)
    # a folded pass covers every row it is given: the core calls it with the batch's tokens only
    x, base = problem.inputs(num_tokens + (0 if case.folded else NUM_UNCOVERED))
    backend = spec.factory(problem.context(len(case.seg_lens), x.shape[0]))
    backend.prepare_batch(problem.info(case.seg_lens, case.slots, len(case.seg_lens)))
    out = problem.run(backend, x, base.clone())
    assert out.shape == base.shape, f"{case}: output shape {tuple(out.shape)}, expected {tuple(base.shape)}"
    assert_close(case, out, problem.reference(x, base, case.seg_lens, case.slots), dtype, "eager")
    assert torch.equal(out[num_tokens:], base[num_tokens:]), f"{case}: rows outside every segment changed"


def check_graph(spec, case: Case, device: str, dtype: torch.dtype, seed: int = 0) -> None:
    """Capture at a padded size on slot 0, then replay two real batches refreshed in place."""
    problem = Problem(case, dtype, device, seed)
    tpr, bs = case.seg_lens[0], len(case.seg_lens)
    padded_bs = bs + 3
    num_rows = padded_bs * tpr
    backend = spec.factory(problem.context(padded_bs, num_rows))
    backend.init_graph_state(padded_bs, num_rows)
    info = problem.info([tpr] * padded_bs, [0] * padded_bs, padded_bs)
    key = ("lora-conformance", case.name, padded_bs)
    backend.init_metadata_for_capture(key, info)
    static_x, static_base = problem.inputs(num_rows)
    static_out = static_base.clone()

    def body() -> None:
        static_out.copy_(static_base)
        problem.run(backend, static_x, static_out)

    replay = _capture(body) if problem.device.type == "cuda" else body
    rng = random.Random(seed)
    for step in range(2):
        slots = list(case.slots) if step == 0 else [rng.randrange(len(case.ranks)) for _ in case.slots]
        seg_lens, pad_slots = list(case.seg_lens) + [tpr] * 3, slots + [0] * 3
        x, base = problem.inputs(num_rows)
        static_x.copy_(x)
        static_base.copy_(base)
        info.update_(seg_lens, pad_slots)
        backend.init_metadata_for_replay(key, info)
        replay()
        assert_close(case, static_out, problem.reference(x, base, seg_lens, pad_slots), dtype, f"replay {step}")


def _capture(body):
    """Warm up, capture `body` in a CUDA graph and return its replay."""
    from backplane.executor.graph_runner import capture_graph

    return capture_graph(body, warmup=1)[0].replay


def applicable(spec, case: Case, device: str, dtype: torch.dtype) -> str | None:
    """Why `case` does not apply to the backend of `spec` (None when it does)."""
    if device not in spec.platforms:
        return f"backend does not run on {device}"
    dtype_name = str(dtype).removeprefix("torch.")
    if dtype_name not in spec.dtypes:
        return f"dtype {dtype_name} not declared"
    if spec.max_rank is not None and spec.max_rank < case.r_max:
        return f"max rank {spec.max_rank} < {case.r_max}"
    if case.graph and not spec.supports_graph:
        return "does not declare graph support"
    return None


def default_dtypes(device: str) -> list[torch.dtype]:
    return [torch.bfloat16] if device == "cuda" else [torch.float32, torch.float16]


def make_suite(backend_name: str, device: str | None = None, dtype: torch.dtype | None = None, plugins=()):
    """A pytest test function parametrized over every conformance case and dtype.

    device: default cuda when available, else cpu; dtype: default bf16 on cuda, fp32 and fp16 on
    cpu; plugins: plugin objects to register besides the installed ones (an unpackaged backend).
    """
    import pytest

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cases = base_cases(small=device == "cpu")
    dtypes = [dtype] if dtype else default_dtypes(device)

    @pytest.mark.parametrize("dtype", dtypes, ids=lambda d: str(d).removeprefix("torch."))
    @pytest.mark.parametrize("case", cases, ids=str)
    def test_lora_conformance(case, dtype):
        spec = _spec(backend_name, plugins)
        reason = spec.available() or applicable(spec, case, device, dtype)
        if reason:
            pytest.skip(f"{backend_name}: {reason}")
        (check_graph if case.graph else check_eager)(spec, case, device, dtype)

    return test_lora_conformance


def _spec(backend_name: str, plugins=()):
    from backplane.plugin.manager import load_plugins

    specs = load_plugins(extra=plugins).registry.specs("lora")
    if backend_name not in specs:
        raise LookupError(f"LoRA backend {backend_name!r} is not registered; registered: {', '.join(sorted(specs))}")
    return specs[backend_name]


__all__ = ["Case", "Problem", "base_cases", "check_eager", "check_graph", "make_suite", "applicable"]
