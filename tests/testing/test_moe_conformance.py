"""backplane.testing.moe_conformance: torch_native and a graph-capturable dense backend written here
pass it (graph cases on a GPU only), and deliberately broken backends fail it with one clear line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backplane.contracts import MoeBackend
from backplane.moe import TorchNativeMoeBackend
from backplane.plugin.registry import MoeBackendSpec
from backplane.testing import moe_conformance as mc

test_torch_native = mc.make_suite("torch_native")


class DenseMoeBackend(MoeBackend):
    """Every expert on every token, then each token's k outputs gathered and weighted: fixed shapes,
    no host sync, so it captures in a CUDA graph (and shows the suite holds a non-reference backend)."""

    def __init__(self, ctx=None):
        self.ctx = ctx

    def apply(self, layer, x, topk_weights, topk_ids):
        inter = layer.w2_weight.shape[-1]
        gate_up = torch.einsum("th,eih->eti", x, layer.w13_weight)  # [E, T, 2I]
        y = torch.einsum("eti,ehi->eth", F.silu(gate_up[..., :inter]) * gate_up[..., inter:], layer.w2_weight)
        tokens = torch.arange(x.shape[0], device=x.device)[:, None]
        picked = y[topk_ids.long(), tokens].float()  # [T, k, H]
        return (picked * topk_weights[..., None]).sum(1).to(x.dtype)


DENSE = MoeBackendSpec(name="dense", factory=DenseMoeBackend, description="dense (test)", supports_graph=True)
test_dense = mc.make_suite(DENSE, cases=[c for c in mc.base_cases() if c.num_experts <= 8 or c.graph])


class DropsTopkWeight(DenseMoeBackend):
    def apply(self, layer, x, topk_weights, topk_ids):
        return super().apply(layer, x, torch.ones_like(topk_weights), topk_ids)


class IgnoresSecondExpert(DenseMoeBackend):
    def apply(self, layer, x, topk_weights, topk_ids):
        return super().apply(layer, x, topk_weights[:, :1].contiguous(), topk_ids[:, :1].contiguous())


class ShardsAgain(TorchNativeMoeBackend):
    """Takes its rank's slice of weights the layer already sharded: right on one rank only."""

    def process_weights_after_loading(self, layer):
        info = layer.moe_info
        self.weights = _Weights(*mc.rank_slice(layer.w13_weight, layer.w2_weight, info.tp_rank, info.tp_size))

    def apply(self, layer, x, topk_weights, topk_ids):
        return super().apply(self.weights, x, topk_weights, topk_ids)


class _Weights:
    def __init__(self, w13, w2):
        self.w13_weight, self.w2_weight = w13, w2


class KeepsWeightsFromRegistration(TorchNativeMoeBackend):
    """Takes its weights at register_layer, before the loader fills them."""

    def register_layer(self, layer, info):
        self.weights = _Weights(layer.w13_weight.clone(), layer.w2_weight.clone())

    def apply(self, layer, x, topk_weights, topk_ids):
        return super().apply(self.weights, x, topk_weights, topk_ids)


class CachesTheFirstRouting(DenseMoeBackend):
    def apply(self, layer, x, topk_weights, topk_ids):
        if not hasattr(self, "ids"):
            self.ids, self.weights = topk_ids.clone(), topk_weights.clone()
        return super().apply(layer, x, self.weights, self.ids)


class WritesIntoX(DenseMoeBackend):
    def apply(self, layer, x, topk_weights, topk_ids):
        return x.copy_(super().apply(layer, x, topk_weights, topk_ids))


class ReturnsFloat32(TorchNativeMoeBackend):
    def apply(self, layer, x, topk_weights, topk_ids):
        return super().apply(layer, x, topk_weights, topk_ids).float()


CASES = {c.name: c for c in mc.base_cases()}
WHERE = r"max \|error\| \S+ at token \d+, column \d+ \(reference \S+, got \S+; it went to experts \[[\d, ]+\] with " \
        r"weights \[[\d., ]+\]\) exceeds \S+ = 0.002 x max \|reference\| \S+; \d+ of \d+ tokens off$"


def _fails(backend, case, match, dtype=torch.float32, check=mc.check_eager):
    with pytest.raises(AssertionError, match=match) as err:
        check(backend, CASES[case], "cpu", dtype)
    assert "\n" not in str(err.value)


def test_dropping_the_topk_weight_fails_with_where_and_how_much():
    _fails(DropsTopkWeight, "tokens-8", r"^DropsTopkWeight tokens-8 float32: " + WHERE)


def test_ignoring_the_second_expert_fails():
    _fails(IgnoresSecondExpert, "experts-8-top-2", r"^IgnoresSecondExpert experts-8-top-2 float32: " + WHERE)


def test_ignoring_the_second_expert_passes_top_1_only():
    mc.check_eager(IgnoresSecondExpert, CASES["experts-8-top-1"], "cpu", torch.float32)


def test_weights_taken_before_loading_give_nan():
    _fails(KeepsWeightsFromRegistration, "tokens-3", r"^KeepsWeightsFromRegistration tokens-3 float32: output has NaN "
                                                     r"or inf \(at token 0\)$")


def test_a_stale_routing_fails_on_the_second_call():
    _fails(CachesTheFirstRouting, "tokens-32", r"^CachesTheFirstRouting tokens-32 float32 \(call 2: same routing\): "
           + WHERE)


def test_writing_into_x_is_caught():
    _fails(WritesIntoX, "tokens-8", r"^WritesIntoX tokens-8 float32: apply modified its input x; expected inputs left "
                                    r"unchanged$")


def test_the_output_dtype_is_x_dtype():
    _fails(ReturnsFloat32, "tokens-3", r"^ReturnsFloat32 tokens-3 bfloat16: output dtype torch.float32, expected x's "
                                       r"dtype torch.bfloat16$", dtype=torch.bfloat16)


def test_the_tp_case_catches_a_backend_ignoring_its_slice():
    mc.check_eager(ShardsAgain, CASES["tokens-32"], "cpu", torch.float32)  # one rank: right
    _fails(ShardsAgain, "tp-32", r"^ShardsAgain tp-32 float32 rank 0 against the "
                                                 r"reference on its half of the intermediate dimension: " + WHERE,
           check=mc.check_tp)


def test_applicable_skips_what_the_spec_does_not_declare():
    spec = MoeBackendSpec(name="small", factory=DenseMoeBackend, description="", platforms=("cuda",), max_top_k=2,
                          max_experts=8, dtypes=("bfloat16",))
    assert mc.applicable(spec, CASES["tokens-8"], "cpu", torch.bfloat16) == "backend does not run on cpu"
    assert mc.applicable(spec, CASES["tokens-8"], "cuda", torch.float32) == "dtype float32 not declared"
    assert mc.applicable(spec, CASES["experts-8-top-8"], "cuda", torch.bfloat16) == "top_k 8 > max_top_k 2"
    assert mc.applicable(spec, CASES["experts-64-top-2"], "cuda", torch.bfloat16) == "64 experts > max_experts 8"
    assert mc.applicable(spec, CASES["graph-32"], "cuda", torch.bfloat16) == "does not declare supports_graph"
    assert mc.applicable(spec, CASES["tokens-8"], "cuda", torch.bfloat16) is None
    assert mc.applicable(DENSE, CASES["graph-32"], "cpu", torch.float32) == "graph cases need CUDA"


def test_a_bare_factory_is_a_spec_of_the_defaults():
    spec = mc.resolve(TorchNativeMoeBackend)
    assert spec.name == "TorchNativeMoeBackend" and not spec.supports_graph
    with pytest.raises(LookupError, match=r"^MoE backend 'nope' is not registered; registered: .*torch_native"):
        mc.resolve("nope")


def test_the_suite_covers_the_issue():
    cases = mc.base_cases()
    assert {c.num_tokens for c in cases} >= {0, 1, 3, 8, 32, 64, 256}
    assert {(c.num_experts, c.top_k) for c in cases} >= set(mc.SHAPES)
    assert {c.routing for c in cases} == set(mc.ROUTINGS)
    assert any(c.tp for c in cases) and any(c.graph for c in cases) and any(not c.renormalize for c in cases)


def test_graph_replays_on_the_cpu_with_a_rerun_stand_in():
    """The graph check's static buffers and replays, without the recording (that runs on a GPU)."""
    from backplane.executor.graph_runner import rerun_capture

    for name in ("graph-decode-1", "graph-32", "graph-256-experts-64-top-8"):
        mc.check_graph(DENSE, CASES[name], "cpu", torch.float32, capture=rerun_capture)
    with pytest.raises(AssertionError, match=r"^CachesTheFirstRouting graph-32 float32 replay with random routing: "
                                             + WHERE):
        mc.check_graph(CachesTheFirstRouting, CASES["graph-32"], "cpu", torch.float32, capture=rerun_capture)


@pytest.mark.gpu
def test_a_stale_routing_fails_a_graph_replay():
    with pytest.raises(AssertionError, match=r"^CachesTheFirstRouting graph-32 bfloat16 replay with random routing: "):
        mc.check_graph(CachesTheFirstRouting, CASES["graph-32"], "cuda", torch.bfloat16)


@pytest.mark.gpu
def test_a_backend_that_syncs_cannot_be_captured():
    spec = MoeBackendSpec(name="torch_native_claiming_graphs", factory=TorchNativeMoeBackend, description="",
                          supports_graph=True)
    with pytest.raises(AssertionError, match=r"^torch_native_claiming_graphs graph-32 bfloat16: apply could not be "
                                             r"captured in a CUDA graph"):
        mc.check_graph(spec, CASES["graph-32"], "cuda", torch.bfloat16)
