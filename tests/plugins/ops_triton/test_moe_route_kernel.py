"""The Triton `moe_route` kernel under TRITON_INTERPRET=1 against the native op (fp32 and fp16 logits):
the k largest softmax probabilities, ties to the lower expert id, renormalised when asked; T = 0
without a launch; one opaque call under torch.compile; and a tiny Qwen3-MoE engine generating the same
greedy tokens with `--custom-ops moe_route=triton` as with native, the op summary naming triton only
when asked."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere: run kernels on CPU

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from backplane import Engine, SamplingParams  # noqa: E402
from backplane.ops import native  # noqa: E402
from backplane.plugins.ops_triton import kernels, ops  # noqa: E402

DTYPES = [torch.float32, torch.float16]


def reference(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of softmax(logits) in fp32, equal probabilities in increasing expert id (a stable
    descending sort: what torch.topk gives on CUDA; torch.topk on CPU may order ties either way)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def grid_logits(num_tokens: int, num_experts: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random logits on a grid of 1/8: equal ones are common, unequal ones far apart in probability."""
    gen = torch.Generator().manual_seed(seed)
    return ((torch.randn(num_tokens, num_experts, generator=gen) * 8).round() / 8).to(dtype)


def check(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    weights, ids = ops.moe_route(logits, top_k, renormalize)
    want_weights, want_ids = reference(logits, top_k, renormalize)
    native_weights, native_ids = native.moe_route(logits, top_k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (logits.shape[0], top_k)
    assert torch.equal(ids, want_ids)
    # the weights do not depend on how ties are ordered: equal to native's to an ulp or two
    torch.testing.assert_close(weights, native_weights, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=1e-7)
    tie_free = (native_ids == want_ids).all(dim=-1)
    assert torch.equal(ids[tie_free], native_ids[tie_free])
    return weights, ids


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_experts", [8, 60, 128])
@pytest.mark.parametrize("num_tokens", [1, 7, 19])
def test_equals_native(num_tokens, num_experts, dtype):
    logits = grid_logits(num_tokens, num_experts, dtype, seed=num_tokens * num_experts)
    for top_k in (1, 2, 3, 8) if num_tokens > 7 else range(1, 9):
        for renormalize in (True, False):
            check(logits, top_k, renormalize)


@pytest.mark.parametrize("dtype", DTYPES)
def test_planted_ties_go_to_the_lower_id(dtype):
    logits = torch.zeros(3, 60, dtype=dtype)
    logits[0, [41, 7]] = 3.0  # the two largest equal: 7 first
    logits[1, [50, 2, 30]] = torch.tensor([1.0, 2.0, 2.0], dtype=dtype)  # 2 and 30 equal, then 50
    logits[2] = -1.0  # all equal: 0, 1, 2, ...
    weights, ids = check(logits, 4, False)
    assert ids[:, :3].tolist() == [[7, 41, 0], [2, 30, 50], [0, 1, 2]]
    assert weights[0, 0] == weights[0, 1] and weights[1, 0] == weights[1, 1]
    weights, _ = check(logits, 2, True)
    assert weights[0].tolist() == [0.5, 0.5]


def test_wide_rows_and_extremes():
    """E = 1024 (one block of the largest size), k = E (every expert, in order), underflowed
    probabilities (still chosen before any padding lane), one expert."""
    wide = grid_logits(5, 1024, torch.float32, seed=3) * 4
    check(wide, 8, True)
    check(grid_logits(3, 20, torch.float32, seed=4), 20, True)
    underflow = torch.tensor([[0.0, -200.0, -300.0, 200.0, -250.0]])  # all but expert 3 underflow to 0
    weights, ids = check(underflow, 5, False)
    assert ids.tolist() == [[3, 0, 1, 2, 4]] and weights[0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    weights, ids = check(torch.randn(4, 1), 1, True)
    assert weights.tolist() == [[1.0]] * 4 and ids.tolist() == [[0]] * 4
    nan_row = grid_logits(2, 60, torch.float32, seed=5)
    nan_row[1, 7] = float("nan")
    weights, ids = ops.moe_route(nan_row, 8, True)
    assert torch.equal(ids[0], reference(nan_row[:1], 8, True)[1][0])
    assert ((ids >= 0) & (ids < 60)).all()  # the NaN row's weights are meaningless, its ids still real experts


def test_no_tokens_no_launch(monkeypatch):
    monkeypatch.setattr(kernels, "_moe_route_kernel", None)  # a launch would fail
    weights, ids = ops.moe_route(torch.empty(0, 60), 4, True)
    assert weights.shape == ids.shape == (0, 4) and weights.dtype == torch.float32 and ids.dtype == torch.int32


def test_other_inputs_go_to_native(monkeypatch):
    """More than 1024 experts, a strided row, fp64: native's results exactly (the kernel never runs)."""
    monkeypatch.setattr(kernels, "moe_route", None)
    for logits in (grid_logits(3, 1025, torch.float32, 1), grid_logits(60, 3, torch.float32, 2).t(),
                   grid_logits(3, 60, torch.float64, 3)):
        weights, ids = ops.moe_route(logits, 2, True)
        want = native.moe_route(logits, 2, True)
        assert torch.equal(weights, want[0]) and torch.equal(ids, want[1])


def test_one_opaque_call_under_torch_compile():
    seen = []

    def recording(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    logits = grid_logits(5, 60, torch.float32, seed=5)
    compiled = torch.compile(lambda x: ops.moe_route(x, 4, True), backend=recording, fullgraph=True)
    weights, ids = compiled(logits)
    assert "ops_triton.moe_route.default" in seen, seen
    want = reference(logits, 4, True)
    assert torch.equal(ids, want[1])
    torch.testing.assert_close(weights, want[0], rtol=1e-6, atol=1e-7)


# -- the engine ---------------------------------------------------------------------------------------
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [20]]
ENGINE = dict(device="cpu", dtype="float32", attention_backend="torch_native", max_total_tokens=1024,
              max_running_requests=4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random tiny Qwen3-MoE (16 experts, 4 a token, renormalised) saved as a checkpoint."""
    config = transformers.Qwen3MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300,
                                         num_hidden_layers=2, max_position_embeddings=512, num_experts=16,
                                         num_experts_per_tok=4, norm_topk_prob=True)
    config.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen3-moe")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


def _tokens(engine) -> list[list[int]]:
    params = [SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)] * len(PROMPTS)
    return [out.token_ids for out in engine.generate(input_ids=PROMPTS, sampling_params=params)]


def test_engine_greedy_with_the_triton_router_equals_native(model_dir, monkeypatch):
    launches = []
    real = kernels.moe_route
    monkeypatch.setattr(kernels, "moe_route", lambda *a: launches.append(a[0].shape) or real(*a))
    native_engine = Engine(model_dir, **ENGINE)
    assert native_engine.backends["custom_ops"]["moe_route"] == "native"
    want = _tokens(native_engine)
    assert not launches
    engine = Engine(model_dir, custom_ops=["moe_route=triton"], **ENGINE)
    assert engine.backends["custom_ops"]["moe_route"] == "triton"
    assert {op for op, name in engine.backends["custom_ops"].items() if name == "triton"} == {"moe_route"}
    launches.clear()  # the startup probe launched once
    assert _tokens(engine) == want
    assert len(launches) >= 2 * 5 and all(shape[1] == 16 for shape in launches)  # 2 layers, every step
