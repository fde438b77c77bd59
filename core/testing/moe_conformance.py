"""MoE-backend conformance: any MoE backend against the torch_native reference.

In a plugin's test suite:

    from backplane.testing import moe_conformance
    test_mine = moe_conformance.make_suite("mine")   # a registered backend; or a MoeBackendSpec, or a factory

Each case builds a standalone MoE layer as the core's FusedMoE presents it to a backend (`MoeLayer`:
stacked `w13_weight` [E, 2 * I, H] and `w2_weight` [E, H, I], `moe_info`, `ctx.moe_backend`, a
handle) and takes the backend through its life: the factory, `register_layer` before the weights
are loaded (they hold NaN until then), the weights copied in as the loader does,
`process_weights_after_loading`, then `apply` twice (the case's routing, then another) with routing
from `backplane.moe.route`. The output is compared with torch_native in float64 on the weights as
loaded (max |error| <= TOLERANCE[dtype] x max |reference|), and the inputs must come back unchanged.

Cases: tokens 0 to 256; (experts, top-k) over {4, 8, 64} x {1, 2, 8}; uneven routing (every token
on the same k experts); empty experts (only k + 1 experts reachable); weights not renormalised;
tensor parallelism (two ranks, each half of the intermediate dimension: each equals the reference
on its slice, and their partial sums the full layer); graphs (marked `gpu`, for a spec declaring
supports_graph: `apply` captured in a CUDA graph on static buffers, replayed with new tokens and
routings, equal to the reference and to eager). Cases beyond the spec's max_top_k / max_experts,
platforms or dtypes are skipped with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import torch

from backplane.contracts.moe import MoeBackendContext, MoeLayerInfo
from backplane.moe import moe_reference, register_moe_layer, route

TOKENS = (0, 1, 3, 8, 32, 64, 256)
SHAPES = ((4, 1), (4, 2), (8, 1), (8, 2), (8, 8), (64, 1), (64, 2), (64, 8))  # (experts, top-k)
TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-3, torch.float16: 5e-3, torch.bfloat16: 3e-2}
SIZES = {"cpu": (64, 48), "cuda": (512, 352)}  # (hidden, intermediate); halves 24 and 176 under TP
ROUTINGS = ("random", "same", "few")


@dataclass(frozen=True)
class Case:
    """One check. routing: "random" (softmax of random logits), "same" (every token on the same k
    experts, the last ones), "few" (only k + 1 experts reachable, the others empty). tp: two
    ranks; graph: capture and replay (CUDA)."""

    name: str
    num_tokens: int
    num_experts: int
    top_k: int
    routing: str = "random"
    renormalize: bool = True
    tp: bool = False
    graph: bool = False

    def __str__(self) -> str:
        return self.name


def base_cases() -> list[Case]:
    """Every case; a plugin may pass a subset to `make_suite(cases=...)` (e.g. fewer tokens under an
    interpreter)."""
    cases = [Case(f"tokens-{t}", t, 8, 2) for t in TOKENS]
    cases += [Case(f"experts-{e}-top-{k}", 32, e, k) for e, k in SHAPES]
    cases += [
        Case("decode-experts-64-top-8", 1, 64, 8),
        Case("prefill-256-experts-64-top-8", 256, 64, 8),
        Case("one-expert-256", 256, 8, 1, "same"),
        Case("same-2-experts-64", 64, 8, 2, "same"),
        Case("same-8-of-64-experts-256", 256, 64, 8, "same"),
        Case("empty-experts-8-tokens", 8, 64, 2, "few"),
        Case("empty-experts-32-tokens", 32, 8, 2, "few"),
        Case("not-renormalized", 17, 8, 2, renormalize=False),
        Case("not-renormalized-top-8", 64, 64, 8, renormalize=False),
        Case("tp-32", 32, 8, 2, tp=True),
        Case("tp-64-experts-64-top-8", 64, 64, 8, tp=True),
        Case("tp-0", 0, 8, 2, tp=True),
        Case("graph-decode-1", 1, 64, 8, graph=True),
        Case("graph-32", 32, 8, 2, graph=True),
        Case("graph-256-experts-64-top-8", 256, 64, 8, graph=True),
    ]
    return cases


# -- the layer and the problem ---------------------------------------------------------------------

class MoeLayer(torch.nn.Module):
    """A MoE layer as FusedMoE presents it to a backend: `w13_weight` [E, 2 * I_local, H] (gate rows,
    then up rows), `w2_weight` [E, H, I_local], `moe_info`, `ctx.moe_backend` and `handle` (for
    torch.ops.backplane.moe_experts). The weights hold NaN until `load` copies them in."""

    def __init__(self, info: MoeLayerInfo, backend: Any):
        super().__init__()
        num_experts, hidden, inter = info.num_experts, info.hidden_size, info.intermediate_size_per_partition
        kw = dict(dtype=info.params_dtype, device=info.device)
        self.w13_weight = torch.nn.Parameter(torch.full((num_experts, 2 * inter, hidden), float("nan"), **kw),
                                             requires_grad=False)
        self.w2_weight = torch.nn.Parameter(torch.full((num_experts, hidden, inter), float("nan"), **kw),
                                            requires_grad=False)
        self.moe_info = info
        self.ctx = SimpleNamespace(moe_backend=backend)
        self.handle = register_moe_layer(self)

    def load(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        with torch.no_grad():
            self.w13_weight.copy_(w13)
            self.w2_weight.copy_(w2)


def rank_slice(w13: torch.Tensor, w2: torch.Tensor, rank: int, tp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's experts: its slice of the gate rows and of the up rows of w13, of the columns of w2."""
    inter = w2.shape[-1]
    local = inter // tp_size
    cols = slice(rank * local, (rank + 1) * local)
    return torch.cat([w13[:, :inter][:, cols], w13[:, inter:][:, cols]], dim=1), w2[:, :, cols]


class Problem:
    """Random weights (rounded to `dtype`), tokens and routings of one case, made on the CPU."""

    def __init__(self, case: Case, dtype: torch.dtype, device: str, seed: int = 0,
                 sizes: tuple[int, int] | None = None):
        self.case, self.dtype, self.device = case, dtype, torch.device(device)
        self.hidden, self.inter = sizes or SIZES.get(self.device.type, SIZES["cuda"])
        self.gen = torch.Generator().manual_seed(seed)
        e, h, i = case.num_experts, self.hidden, self.inter
        self.w13 = (self.randn(e, 2 * i, h) / h**0.5).to(dtype)
        self.w2 = (self.randn(e, h, i) / i**0.5).to(dtype)

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen)

    def tokens(self, num_tokens: int) -> torch.Tensor:
        return self.randn(num_tokens, self.hidden).to(self.device, self.dtype)

    def routing(self, num_tokens: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights [T, k] fp32, topk_ids [T, k] int32) from route over random logits, only the
        experts of `kind` reachable."""
        e, k = self.case.num_experts, self.case.top_k
        logits = self.randn(num_tokens, e)
        if kind != "random":
            reachable = list(range(e - k, e)) if kind == "same" else torch.randperm(e, generator=self.gen)[:k + 1]
            mask = torch.full((e,), float("-inf"))
            mask[reachable] = 0.0
            logits = logits + mask
        weights, ids = route(logits, k, self.case.renormalize)
        return weights.to(self.device), ids.to(self.device)

    def layer(self, backend_factory: Callable, max_num_tokens: int, options=None, rank: int = 0,
              tp_size: int = 1) -> MoeLayer:
        """The backend built for one model and one layer of it, through its whole life cycle."""
        ctx = MoeBackendContext(dtype=self.dtype, device=self.device, max_num_tokens=max(max_num_tokens, 1),
                                options=options)
        backend = backend_factory(ctx)
        info = MoeLayerInfo(layer_id=0, num_experts=self.case.num_experts, top_k=self.case.top_k,
                            hidden_size=self.hidden, intermediate_size=self.inter,
                            intermediate_size_per_partition=self.inter // tp_size, renormalize=self.case.renormalize,
                            params_dtype=self.dtype, device=self.device, tp_rank=rank, tp_size=tp_size)
        layer = MoeLayer(info, backend)
        backend.register_layer(layer, info)
        layer.load(*(w.to(self.device) for w in rank_slice(self.w13, self.w2, rank, tp_size)))
        backend.process_weights_after_loading(layer)
        return layer

    def reference(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, rank: int = 0,
                  tp_size: int = 1) -> torch.Tensor:
        """torch_native in float64 on the CPU over this rank's experts: [T, H]."""
        w13, w2 = rank_slice(self.w13, self.w2, rank, tp_size)
        return moe_reference(x.cpu().double(), w13.double(), w2.double(), weights.cpu(), ids.cpu())


# -- the checks ------------------------------------------------------------------------------------

def compare(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str,
            weights: torch.Tensor | None = None, ids: torch.Tensor | None = None) -> None:
    """max |got - want| <= TOLERANCE[dtype] * max |want|, else one line with where, by how much and
    the token's routing."""
    if tuple(got.shape) != tuple(want.shape):
        raise AssertionError(f"{what}: output shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    if got.dtype != dtype:
        raise AssertionError(f"{what}: output dtype {got.dtype}, expected x's dtype {dtype}")
    if got.numel() == 0:
        return
    err = (got.double().cpu() - want).abs()
    if not bool(torch.isfinite(err).all()):
        raise AssertionError(f"{what}: output has NaN or inf (at token {int((~torch.isfinite(err)).nonzero()[0, 0])})")
    scale = max(float(want.abs().max()), 1e-6)
    allowed = TOLERANCE[dtype] * scale
    worst = float(err.max())
    if worst <= allowed:
        return
    token, col = divmod(int(err.argmax()), err.shape[-1])
    bad_tokens = int((err.amax(-1) > allowed).sum())
    routing = ""
    if ids is not None:
        routing = (f"; it went to experts {ids[token].tolist()} with weights "
                   f"{[round(w, 4) for w in weights[token].tolist()]}")
    raise AssertionError(
        f"{what}: max |error| {worst:.3g} at token {token}, column {col} (reference {float(want[token, col]):.5g}, "
        f"got {float(got[token, col]):.5g}{routing}) exceeds {allowed:.3g} = {TOLERANCE[dtype]:g} x max |reference| "
        f"{scale:.3g}; {bad_tokens} of {err.shape[0]} tokens off")


def apply_checked(layer: MoeLayer, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  what: str) -> torch.Tensor:
    """The backend's apply; its inputs must come back unchanged."""
    before = (x.clone(), weights.clone(), ids.clone())
    out = layer.ctx.moe_backend.apply(layer, x, weights, ids)
    for name, old, new in zip(("x", "topk_weights", "topk_ids"), before, (x, weights, ids)):
        if not torch.equal(old, new):
            raise AssertionError(f"{what}: apply modified its input {name}; expected inputs left unchanged")
    return out


def check_eager(backend, case: Case, device: str, dtype: torch.dtype, seed: int = 0, options=None,
                sizes: tuple[int, int] | None = None) -> None:
    """`backend` (a spec, or a factory ctx -> MoeBackend) on `case`, twice: the case's routing, then
    another on new tokens; each against the float64 reference."""
    spec = resolve(backend)
    problem = Problem(case, dtype, device, seed, sizes)
    layer = problem.layer(spec.factory, case.num_tokens, options)
    second = "random" if case.routing != "random" else "same"
    for call, kind in enumerate((case.routing, second), start=1):
        what = f"{spec.name} {case} {_dtype_name(dtype)}" + (f" (call {call}: {kind} routing)" if call > 1 else "")
        x = problem.tokens(case.num_tokens)
        weights, ids = problem.routing(case.num_tokens, kind)
        got = apply_checked(layer, x, weights, ids, what)
        compare(got, problem.reference(x, weights, ids), dtype, what, weights, ids)


def check_tp(backend, case: Case, device: str, dtype: torch.dtype, seed: int = 0, options=None,
             sizes: tuple[int, int] | None = None) -> None:
    """Two tensor-parallel ranks, each with half of every expert's intermediate dimension: each rank
    equals the reference on its slice; the sum of their partial outputs equals the full layer's."""
    spec = resolve(backend)
    problem = Problem(case, dtype, device, seed, sizes)
    if problem.inter % 2:
        raise ValueError(f"moe_conformance: intermediate size {problem.inter} must be even for a tp case")
    x = problem.tokens(case.num_tokens)
    weights, ids = problem.routing(case.num_tokens, case.routing)
    what = f"{spec.name} {case} {_dtype_name(dtype)}"
    partial = []
    for rank in range(2):
        layer = problem.layer(spec.factory, case.num_tokens, options, rank=rank, tp_size=2)
        out = apply_checked(layer, x, weights, ids, f"{what} rank {rank}")
        compare(out, problem.reference(x, weights, ids, rank, 2), dtype,
                f"{what} rank {rank} against the reference on its half of the intermediate dimension", weights, ids)
        partial.append(out.double().cpu())
    compare((partial[0] + partial[1]).to(dtype), problem.reference(x, weights, ids), dtype,
            f"{what}: the two ranks' partial sums against the full layer", weights, ids)


def check_graph(backend, case: Case, device: str, dtype: torch.dtype, seed: int = 0, options=None,
                sizes: tuple[int, int] | None = None, capture: Callable | None = None) -> None:
    """`apply` captured in a CUDA graph on static x / topk_weights / topk_ids, replayed with new
    tokens under each routing kind: equal to the reference and to the same backend run eagerly.
    capture: `capture_graph` (default, CUDA) or a stand-in of its signature such as
    backplane.executor.graph_runner.rerun_capture (any device; the recording itself is not checked)."""
    from backplane.executor.graph_runner import capture_graph

    spec = resolve(backend)
    if capture is None and torch.device(device).type != "cuda":
        raise ValueError(f"moe_conformance: graph cases need a CUDA device, got {device!r}")
    problem = Problem(case, dtype, device, seed, sizes)
    layer = problem.layer(spec.factory, case.num_tokens, options)
    what = f"{spec.name} {case} {_dtype_name(dtype)}"
    static_x = problem.tokens(case.num_tokens)
    static_weights, static_ids = problem.routing(case.num_tokens, "random")
    try:
        graph, static_out = (capture or capture_graph)(
            lambda: layer.ctx.moe_backend.apply(layer, static_x, static_weights, static_ids))
    except RuntimeError as err:
        raise AssertionError(f"{what}: apply could not be captured in a CUDA graph ({str(err).splitlines()[0]}); a "
                             "backend declaring supports_graph must not sync with the host or allocate by the "
                             "routing") from err
    for kind in ROUTINGS:
        x = problem.tokens(case.num_tokens)
        weights, ids = problem.routing(case.num_tokens, kind)
        static_x.copy_(x)
        static_weights.copy_(weights)
        static_ids.copy_(ids)
        graph.replay()
        replayed = static_out.clone()  # before eager: a backend may return the same static buffer
        label = f"{what} replay with {kind} routing"
        compare(replayed, problem.reference(x, weights, ids), dtype, label, weights, ids)
        eager = layer.ctx.moe_backend.apply(layer, x, weights, ids)
        compare(replayed, eager.double().cpu(), dtype, f"{label} against eager", weights, ids)


def run_case(backend, case: Case, device: str, dtype: torch.dtype, seed: int = 0, options=None,
             sizes: tuple[int, int] | None = None) -> None:
    check = check_graph if case.graph else check_tp if case.tp else check_eager
    check(backend, case, device, dtype, seed, options, sizes)


# -- the pytest suite ------------------------------------------------------------------------------

def applicable(spec, case: Case, device: str, dtype: torch.dtype) -> str | None:
    """Why `case` does not apply to the backend of `spec` (None when it does)."""
    if device not in spec.platforms:
        return f"backend does not run on {device}"
    if _dtype_name(dtype) not in spec.dtypes:
        return f"dtype {_dtype_name(dtype)} not declared"
    if spec.max_top_k is not None and case.top_k > spec.max_top_k:
        return f"top_k {case.top_k} > max_top_k {spec.max_top_k}"
    if spec.max_experts is not None and case.num_experts > spec.max_experts:
        return f"{case.num_experts} experts > max_experts {spec.max_experts}"
    if case.graph and not spec.supports_graph:
        return "does not declare supports_graph"
    if case.graph and device != "cuda":
        return "graph cases need CUDA"
    return None


def default_dtypes(device: str) -> list[torch.dtype]:
    return [torch.bfloat16] if device == "cuda" else [torch.float32]


def make_suite(backend, device: str | None = None, dtype: torch.dtype | None = None, plugins=(), options=None,
               cases: Sequence[Case] | None = None, sizes: tuple[int, int] | None = None):
    """A pytest test function parametrized over every conformance case and dtype.

    backend: a registered backend's name, a MoeBackendSpec (checked as declared, registered or not),
    or a bare factory ctx -> MoeBackend (a spec of the defaults: no graph cases). device: cuda when
    available, else cpu; dtype: bf16 on cuda, fp32 on cpu; plugins: plugin objects to register besides
    the installed ones; options: the plugin's settings object handed to the factory; cases: a subset
    of `base_cases()`; sizes: (hidden, intermediate) instead of SIZES[device]. Graph cases carry the
    `gpu` marker.
    """
    import pytest

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtypes = [dtype] if dtype else default_dtypes(device)
    params = [pytest.param(c, id=str(c), marks=[pytest.mark.gpu] if c.graph else [])
              for c in (base_cases() if cases is None else cases)]

    @pytest.mark.parametrize("dtype", dtypes, ids=_dtype_name)
    @pytest.mark.parametrize("case", params)
    def test_moe_conformance(case, dtype):
        spec = resolve(backend, plugins)
        reason = spec.available() or applicable(spec, case, device, dtype)
        if reason:
            pytest.skip(f"{spec.name}: {reason}")
        run_case(spec, case, device, dtype, options=options, sizes=sizes)

    return test_moe_conformance


def resolve(backend, plugins=()):
    """The MoeBackendSpec of a registered name, a spec, or a bare factory (a spec of the defaults)."""
    from backplane.plugin.registry import MoeBackendSpec

    if isinstance(backend, str):
        from backplane.plugin.manager import load_plugins

        specs = load_plugins(extra=plugins).registry.specs("moe")
        if backend not in specs:
            raise LookupError(f"MoE backend {backend!r} is not registered; registered: {', '.join(sorted(specs)) or 'none'}")
        return specs[backend]
    if hasattr(backend, "factory"):
        return backend
    if callable(backend):
        return MoeBackendSpec(name=getattr(backend, "__name__", "factory"), factory=backend,
                              description="a MoE backend factory under test")
    raise TypeError(f"moe_conformance: backend must be a registered name, a MoeBackendSpec or a factory "
                    f"ctx -> MoeBackend, got {type(backend).__name__}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


__all__ = ["Case", "MoeLayer", "Problem", "TOLERANCE", "applicable", "base_cases", "check_eager", "check_graph",
           "check_tp", "compare", "make_suite", "rank_slice", "resolve", "run_case"]
