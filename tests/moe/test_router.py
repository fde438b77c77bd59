"""backplane.moe.route against transformers' routers (Mixtral: renormalised; Qwen2-MoE: not;
Qwen3-MoE: by norm_topk_prob), and whole HF sparse-MoE blocks against route + moe_reference with
their weights copied over."""

from __future__ import annotations

import pytest
import torch
from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from backplane.moe import moe_reference, route

HIDDEN, INTER, NUM_TOKENS = 32, 24, 19


def _randomize(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def _mixtral(num_experts, top_k):
    config = MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=num_experts,
                           num_experts_per_tok=top_k)
    return MixtralSparseMoeBlock(config), True


def _qwen2(num_experts, top_k, norm=False):
    config = Qwen2MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, shared_expert_intermediate_size=40,
                            num_experts=num_experts, num_experts_per_tok=top_k, norm_topk_prob=norm)
    return Qwen2MoeSparseMoeBlock(config), norm


def _qwen3(num_experts, top_k, norm=True):
    config = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=num_experts,
                            num_experts_per_tok=top_k, norm_topk_prob=norm)
    return Qwen3MoeSparseMoeBlock(config), norm


BLOCKS = {
    "mixtral-8x2": lambda: _mixtral(8, 2),
    "mixtral-4x1": lambda: _mixtral(4, 1),
    "qwen2-moe-16x4": lambda: _qwen2(16, 4),
    "qwen2-moe-16x4-norm": lambda: _qwen2(16, 4, norm=True),
    "qwen3-moe-16x8": lambda: _qwen3(16, 8),
    "qwen3-moe-16x8-no-norm": lambda: _qwen3(16, 8, norm=False),
}


def _block(name: str):
    block, renormalize = BLOCKS[name]()
    _randomize(block, seed=len(name))
    return block.eval(), renormalize


@pytest.mark.parametrize("name", list(BLOCKS))
def test_route_equals_the_hf_router(name):
    block, renormalize = _block(name)
    x = torch.randn(NUM_TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))
    logits, want_weights, want_ids = block.gate(x)
    weights, ids = route(logits, block.gate.top_k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_weights.float(), rtol=1e-6, atol=1e-7)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(NUM_TOKENS))
    else:
        assert bool((weights.sum(-1) < 1 - 1e-4).all()), "without renormalisation the k weights sum below 1"


@pytest.mark.parametrize("name", list(BLOCKS))
def test_the_hf_block_equals_route_plus_moe_reference(name):
    """The strongest check: the block's output from its own weights, through our router and the
    reference experts (plus the HF shared expert and its sigmoid gate for Qwen2-MoE)."""
    block, renormalize = _block(name)
    x = torch.randn(1, NUM_TOKENS, HIDDEN, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = block(x)[0]
        flat = x[0]
        weights, ids = route(flat @ block.gate.weight.t(), block.gate.top_k, renormalize)
        got = moe_reference(flat, block.experts.gate_up_proj, block.experts.down_proj, weights, ids)
        if hasattr(block, "shared_expert"):
            got = got + torch.sigmoid(block.shared_expert_gate(flat)) * block.shared_expert(flat)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_route_sorts_and_renormalises_a_known_case():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]], dtype=torch.bfloat16)
    weights, ids = route(logits, 2, renormalize=False)
    probs = torch.softmax(torch.tensor([0.0, 2.0, 1.0, -1.0]), -1)
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(weights, probs[[1, 2]][None])
    weights, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(weights, (probs[[1, 2]] / probs[[1, 2]].sum())[None])


def test_route_of_no_tokens():
    weights, ids = route(torch.randn(0, 8), 2, True)
    assert weights.shape == ids.shape == (0, 2)


def test_route_traces_without_graph_breaks():
    logits = torch.randn(5, 8)
    compiled = torch.compile(route, backend="eager", fullgraph=True)
    for got, want in zip(compiled(logits, 3, True), route(logits, 3, True)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("args, match", [
    ((torch.randn(3, 4), 5, True), r"^route: top_k 5 out of range; expected 1 <= top_k <= num_experts \(4\)$"),
    ((torch.randn(3, 4), 0, True), r"^route: top_k 0 out of range"),
    ((torch.randn(4), 1, True), r"^route: router_logits must be \[num_tokens, num_experts\], got shape \(4,\)$"),
])
def test_route_rejects_bad_input_in_one_line(args, match):
    with pytest.raises(ValueError, match=match):
        route(*args)


def test_route_rejects_an_unknown_scoring():
    with pytest.raises(ValueError, match=r"^route: scoring 'sigmoid' is not supported; expected one of softmax$"):
        route(torch.randn(3, 4), 2, True, scoring="sigmoid")
