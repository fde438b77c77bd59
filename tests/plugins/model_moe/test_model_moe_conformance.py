"""Mixtral, Qwen2-MoE and Qwen3-MoE (plugin model_moe) pass backplane.testing.model_conformance against
transformers on the CPU in fp32, through the engine with the torch_native MoE backend.

The overrides give each a MoE worth the name on the suite's tiny shapes: 4 to 8 experts with top-2 or
top-3 routing, renormalised or not; Qwen2-MoE with its gated shared expert and a dense layer
(`mlp_only_layers`, and `decoder_sparse_step` in the second case), always 2 layers so the dense one exists.
A model wrong in one MoE feature fails the suite (so the cases reach each feature).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from backplane import ModelSpec, hookimpl
from backplane.layers import FusedMoE
from backplane.plugins.model_moe import model as moe
from backplane.testing import model_conformance
from backplane.testing.model_conformance import check_model, save_reference

MIXTRAL = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)
QWEN2_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                 num_hidden_layers=2, mlp_only_layers=[1], norm_topk_prob=False)
QWEN2_MOE_SPARSE_STEP = dict(QWEN2_MOE, mlp_only_layers=[], decoder_sparse_step=2, norm_topk_prob=True)
QWEN3_MOE = dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True)

test_mixtral = model_conformance.make_suite("MixtralForCausalLM", transformers.MixtralConfig, seeds=(0,), **MIXTRAL)
test_qwen2_moe = model_conformance.make_suite("Qwen2MoeForCausalLM", transformers.Qwen2MoeConfig, seeds=(0,),
                                              **QWEN2_MOE)
test_qwen2_moe_sparse_step = model_conformance.make_suite(
    "Qwen2MoeForCausalLM", transformers.Qwen2MoeConfig, seeds=(1,), checks=("greedy",), **QWEN2_MOE_SPARSE_STEP)
test_qwen3_moe = model_conformance.make_suite("Qwen3MoeForCausalLM", transformers.Qwen3MoeConfig, seeds=(0,),
                                              **QWEN3_MOE)


# -- planted bugs: MoE models each wrong in one way, served under their own architecture name ------
def _changed(cls, change):
    """A factory building `cls` and then calling change(model)."""
    def factory(hf_config, ctx):
        model = moe.build_model(cls, hf_config, ctx)
        change(model)
        return model
    return factory


def _moe_blocks(model):
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


def _no_renormalization(model):
    for block in _moe_blocks(model):
        block.renormalize = False


def _ungated_shared_expert(model):
    for block in _moe_blocks(model):  # sigmoid(30) = 1: the shared expert added whole
        block.shared_expert_gate.forward = lambda x: x.new_full((x.shape[0], 1), 30.0)


def _one_expert_fewer(model):
    for block in _moe_blocks(model):
        block.top_k -= 1


def _gate_and_up_swapped(model):
    load = model.load_weights

    def swapped(weights, strict=True):
        names = load(weights, strict)
        for block in _moe_blocks(model):
            gate, up = block.w13_weight.data.chunk(2, dim=1)
            block.w13_weight.data.copy_(torch.cat([up, gate], dim=1))
        return names
    model.load_weights = swapped


PLANTED = {  # architecture: (factory, config class, overrides)
    "NoRenormMixtral": (_changed(moe.MixtralForCausalLM, _no_renormalization), transformers.MixtralConfig, MIXTRAL),
    "UngatedSharedQwen2Moe": (_changed(moe.Qwen2MoeForCausalLM, _ungated_shared_expert), transformers.Qwen2MoeConfig,
                              QWEN2_MOE),
    "TopKMinusOneQwen3Moe": (_changed(moe.Qwen3MoeForCausalLM, _one_expert_fewer), transformers.Qwen3MoeConfig,
                             QWEN3_MOE),
    "GateUpSwappedQwen3Moe": (_changed(moe.Qwen3MoeForCausalLM, _gate_and_up_swapped), transformers.Qwen3MoeConfig,
                              QWEN3_MOE),
}


class PlantedBugs:
    @hookimpl
    def backplane_register_models(self, register):
        for architecture, (factory, _, _) in PLANTED.items():
            register(ModelSpec(architecture=architecture, factory=factory, description="a planted bug"))


@pytest.mark.parametrize("architecture", sorted(PLANTED))
def test_the_moe_suite_fails_on_a_planted_bug(architecture, tmp_path):
    _, config_class, overrides = PLANTED[architecture]
    reference = save_reference(architecture, config_class, 0, tmp_path, overrides)
    with pytest.raises(AssertionError, match="transformers"):
        check_model(reference, "greedy", 0, plugins=[PlantedBugs()])
