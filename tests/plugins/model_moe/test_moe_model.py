"""FusedMoE and the MoE models beyond the suite: the layer against a plain per-token loop (shared expert,
renormalisation, no tokens), tensor-parallel halves that add up, experts stacked and sharded per rank
from a transformers checkpoint, the checkpoint layout, bad checkpoints named in one line, the router
left out of quantization, dummy weights, and the import boundary."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from backplane import Engine, SamplingParams
from backplane.layers import FusedMoE, ParallelContext, expert_params_mapping
from backplane.models import ModelContext
from backplane.models.loader import iterate_safetensors, quantize_linears
from backplane.plugins.model_moe import model as moe
from backplane.testing.boundary import check_plugin_imports
from backplane.testing.model_conformance import ENGINE_ARGS

ROOT = Path(__file__).resolve().parents[3]
SHAPE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             vocab_size=300, num_hidden_layers=2, max_position_embeddings=512)
CONFIGS = {  # architecture: (transformers config class, MoE keys)
    "MixtralForCausalLM": (transformers.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2)),
    "Qwen2MoeForCausalLM": (transformers.Qwen2MoeConfig, dict(num_experts=4, num_experts_per_tok=2,
                                                              moe_intermediate_size=32, mlp_only_layers=[1],
                                                              shared_expert_intermediate_size=48)),
    "Qwen3MoeForCausalLM": (transformers.Qwen3MoeConfig, dict(num_experts=6, num_experts_per_tok=3,
                                                              moe_intermediate_size=32, norm_topk_prob=True)),
}


class OneOfTwoRanks(ParallelContext):
    """A rank of two without torch.distributed: all_reduce leaves this rank's partial sum alone."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _config(architecture: str, **overrides):
    cls, keys = CONFIGS[architecture]
    config = cls(**{**SHAPE, **keys, **overrides})
    config.architectures = [architecture]
    return config


def _saved(architecture: str, path: Path, **overrides) -> dict[str, torch.Tensor]:
    """A random transformers model of `architecture` saved at `path`; its checkpoint tensors by name."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(architecture, **overrides))
    model.save_pretrained(path)
    return dict(iterate_safetensors(path))


# -- the layer --------------------------------------------------------------------------------------
def _layer(parallel=None, shared: int = 0, renormalize: bool = True, experts: int = 5, top_k: int = 2) -> FusedMoE:
    ctx = ModelContext(parallel=parallel)
    return FusedMoE(experts, top_k, 24, 20, ctx, layer_id=0, renormalize=renormalize,
                    shared_expert_intermediate_size=shared, shared_expert_gated=shared > 0)


def _full_weights(experts: int = 5, shared: int = 0, seed: int = 0) -> dict[str, torch.Tensor]:
    """Checkpoint-style tensors of one MoE block: router, per-expert w1/w3 [20, 24] and w2 [24, 20]."""
    gen = torch.Generator().manual_seed(seed)
    weights = {"gate": torch.randn(experts, 24, generator=gen)}
    for e in range(experts):
        for name, shape in (("w1", (20, 24)), ("w3", (20, 24)), ("w2", (24, 20))):
            weights[f"{e}.{name}"] = 0.3 * torch.randn(shape, generator=gen)
    if shared:
        for name, shape in (("gate_proj", (shared, 24)), ("up_proj", (shared, 24)), ("down_proj", (24, shared))):
            weights[f"shared.{name}"] = 0.3 * torch.randn(shape, generator=gen)
        weights["shared_gate"] = torch.randn(1, 24, generator=gen)
    return weights


def _load(layer: FusedMoE, weights: dict[str, torch.Tensor]) -> FusedMoE:
    layer.gate.weight.data.copy_(weights["gate"])
    for e in range(layer.num_experts):
        for name, param in (("w1", layer.w13_weight), ("w3", layer.w13_weight), ("w2", layer.w2_weight)):
            param.weight_loader(param, weights[f"{e}.{name}"], (e, name))
    if layer.shared_expert is not None:
        merged = layer.shared_expert.gate_up_proj
        merged.weight_loader(merged.weight, weights["shared.gate_proj"], 0)
        merged.weight_loader(merged.weight, weights["shared.up_proj"], 1)
        down = layer.shared_expert.down_proj
        down.weight_loader(down.weight, weights["shared.down_proj"])
        layer.shared_expert_gate.weight.data.copy_(weights["shared_gate"])
    return layer


def _plain_moe(x: torch.Tensor, weights: dict[str, torch.Tensor], top_k: int, renormalize: bool) -> torch.Tensor:
    """One token at a time: softmax over the router, the top k, each expert's SwiGLU, weighted sum."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(x[t] @ weights["gate"].T, dim=-1)
        top, ids = probs.topk(top_k)
        if renormalize:
            top = top / top.sum()
        for w, e in zip(top.tolist(), ids.tolist()):
            hidden = F.silu(weights[f"{e}.w1"] @ x[t]) * (weights[f"{e}.w3"] @ x[t])
            out[t] += w * (weights[f"{e}.w2"] @ hidden)
        if "shared_gate" in weights:
            shared = weights["shared.down_proj"] @ (F.silu(weights["shared.gate_proj"] @ x[t])
                                                    * (weights["shared.up_proj"] @ x[t]))
            out[t] += torch.sigmoid(weights["shared_gate"] @ x[t]) * shared
    return out


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("shared", [0, 12])
def test_fused_moe_equals_a_plain_loop(renormalize, shared):
    weights = _full_weights(shared=shared)
    layer = _load(_layer(shared=shared, renormalize=renormalize), weights)
    x = torch.randn(17, 24, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(layer(x), _plain_moe(x, weights, 2, renormalize), rtol=1e-5, atol=1e-5)
        assert layer(x[:0]).shape == (0, 24)


@pytest.mark.parametrize("shared", [0, 12])
def test_two_ranks_halves_add_up_to_the_whole_layer(shared):
    """Each rank keeps half of every expert's intermediate rows (and of the shared expert's): the two
    partial sums, before the all-reduce, add up to the one-rank output."""
    weights = _full_weights(shared=shared)
    x = torch.randn(9, 24, generator=torch.Generator().manual_seed(2))
    whole = _load(_layer(shared=shared), weights)
    ranks = [_load(_layer(OneOfTwoRanks(tp_rank=r, tp_size=2), shared=shared), weights) for r in (0, 1)]
    assert ranks[0].w13_weight.shape == (5, 20, 24) and ranks[0].moe_info.intermediate_size_per_partition == 10
    with torch.no_grad():
        torch.testing.assert_close(ranks[0](x) + ranks[1](x), whole(x), rtol=1e-5, atol=1e-5)


def test_weight_loader_refuses_a_wrong_shape_or_expert():
    layer = _layer()
    with pytest.raises(ValueError, match=r"MoE layer 0 expert 3 w2: expected the full checkpoint tensor of shape "
                                         r"\(24, 20\), got \(20, 24\)"):
        layer.weight_loader(layer.w2_weight, torch.zeros(20, 24), (3, "w2"))
    with pytest.raises(ValueError, match=r"expert id 5 out of range; expected 0 <= id < 5"):
        layer.weight_loader(layer.w13_weight, torch.zeros(20, 24), (5, "w1"))
    with pytest.raises(ValueError, match=r"shard_id must be \(expert id, one of w1, w2, w3\), got 'w1'"):
        layer.weight_loader(layer.w13_weight, torch.zeros(20, 24), "w1")


def test_fused_moe_refuses_bad_sizes():
    with pytest.raises(ValueError, match=r"top_k 6 out of range; expected 1 <= top_k <= num_experts \(5\)"):
        _layer(top_k=6)
    with pytest.raises(ValueError, match=r"expert intermediate size: expected a multiple of tp_size=3, got 20"):
        _layer(OneOfTwoRanks(tp_rank=0, tp_size=3))


def test_expert_params_mapping_names():
    mapping = expert_params_mapping(2, "w1", "w3", "w2")
    assert mapping[:3] == [(".w13_", ".experts.0.w1.", (0, "w1")), (".w13_", ".experts.0.w3.", (0, "w3")),
                           (".w2_", ".experts.0.w2.", (0, "w2"))]
    assert len(mapping) == 6


# -- the models -------------------------------------------------------------------------------------
@pytest.mark.parametrize("architecture", sorted(CONFIGS))
@pytest.mark.parametrize("tied", [False, True])
def test_checkpoint_shapes_are_transformers(architecture, tied, tmp_path):
    state = _saved(architecture, tmp_path, tie_word_embeddings=tied)
    family = getattr(moe, architecture)
    assert dict(moe.moe_checkpoint_shapes(_config(architecture, tie_word_embeddings=tied), family)) == {
        name: tuple(t.shape) for name, t in state.items()}


@pytest.mark.parametrize("rank", [0, 1])
def test_experts_stack_and_shard_per_rank(rank, tmp_path):
    """Qwen2-MoE on rank `rank` of 2: each expert's gate/up rows and down columns of this rank, the
    shared expert split the same way, the router whole; the dense layer 1 is a dense MLP."""
    state = _saved("Qwen2MoeForCausalLM", tmp_path)
    config = _config("Qwen2MoeForCausalLM")
    model = moe.Qwen2MoeForCausalLM(config, ModelContext(parallel=OneOfTwoRanks(tp_rank=rank, tp_size=2)))
    model.load_weights(state.items())
    block, p = model.model.layers[0].mlp, "model.layers.0.mlp."
    rows = slice(16 * rank, 16 * rank + 16)  # 32 intermediate rows, 16 per rank
    for e in range(4):
        want = torch.cat([state[f"{p}experts.{e}.gate_proj.weight"][rows], state[f"{p}experts.{e}.up_proj.weight"][rows]])
        assert torch.equal(block.w13_weight[e], want)
        assert torch.equal(block.w2_weight[e], state[f"{p}experts.{e}.down_proj.weight"][:, rows])
    assert torch.equal(block.gate.weight, state[f"{p}gate.weight"])
    assert torch.equal(block.shared_expert_gate.weight, state[f"{p}shared_expert_gate.weight"])
    shared = slice(24 * rank, 24 * rank + 24)
    assert torch.equal(block.shared_expert.down_proj.weight, state[f"{p}shared_expert.down_proj.weight"][:, shared])
    assert not isinstance(model.model.layers[1].mlp, FusedMoE)


def test_a_checkpoint_with_other_experts_is_named(tmp_path):
    state = _saved("MixtralForCausalLM", tmp_path)
    model = moe.MixtralForCausalLM(_config("MixtralForCausalLM"), ModelContext())
    extra = dict(state)
    extra["model.layers.0.block_sparse_moe.experts.4.w1.weight"] = torch.zeros(96, 64)  # config: 4 experts
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.block_sparse_moe\.experts\.4\.w1\.weight' has no "
                                         r"parameter in MixtralForCausalLM"):
        model.load_weights(extra.items())
    wrong = dict(state)
    wrong["model.layers.1.block_sparse_moe.experts.2.w3.weight"] = torch.zeros(64, 96)
    with pytest.raises(ValueError, match=r"MoE layer 1 expert 2 w3: expected the full checkpoint tensor of shape "
                                         r"\(96, 64\), got \(64, 96\)"):
        model.load_weights(wrong.items())


class RecordingQuant:
    """A QuantConfig stand-in that records the layers the core offers it and keeps them unquantized."""

    ignore = ()

    def __init__(self):
        self.offered: list[str] = []

    def method_for(self, layer, name):
        self.offered.append(name)
        return None


def test_the_router_and_shared_gate_are_never_offered_to_quantization():
    model = moe.Qwen2MoeForCausalLM(_config("Qwen2MoeForCausalLM"), ModelContext())
    quant = RecordingQuant()
    quantize_linears(model, quant, model.stacked_params)
    p = "model.layers.0.mlp."
    assert f"{p}shared_expert.gate_up_proj" in quant.offered and "model.layers.1.mlp.down_proj" in quant.offered
    assert not [name for name in quant.offered if name.endswith((".gate", "shared_expert_gate"))], quant.offered


def test_dummy_weights_serve(tmp_path):
    _saved("Qwen3MoeForCausalLM", tmp_path)
    engine = Engine(str(tmp_path), load_format="dummy", **ENGINE_ARGS)
    out = engine.generate(input_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_new_tokens=3, temperature=0.0))
    assert out[0].error is None and len(out[0].token_ids) == 3


def test_plugin_imports_only_public_modules():
    assert check_plugin_imports(ROOT / "plugins" / "model_moe", "backplane.plugins.model_moe") == []
