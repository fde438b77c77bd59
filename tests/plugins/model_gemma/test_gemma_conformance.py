"""Gemma 2 and Gemma 3 (text) pass backplane.testing.model_conformance against transformers on the CPU in fp32,
and a model wrong in one Gemma feature fails it (so the cases reach each feature).

The overrides switch every Gemma feature on where the small random configs reach it: a sliding window
of 8 tokens (shorter than the prompts, so the sliding layers see less than the global ones), attention
and final logit soft-caps low enough to bend the logits, and a query_pre_attn_scalar other than the
head dim.
"""

from __future__ import annotations

import dataclasses

import pytest
import transformers

from backplane import ModelSpec, hookimpl
from backplane.layers import RotaryEmbedding
from backplane.plugins.model_gemma import config as gemma_config
from backplane.plugins.model_gemma import model as gemma
from backplane.testing import model_conformance
from backplane.testing.model_conformance import check_model, save_reference

GEMMA_FEATURES = dict(sliding_window=8, attn_logit_softcapping=4.0, final_logit_softcapping=3.0,
                      query_pre_attn_scalar=24)

test_gemma2 = model_conformance.make_suite("Gemma2ForCausalLM", transformers.Gemma2Config, **GEMMA_FEATURES)
# Gemma 3: layer 0 sliding, layer 1 (when drawn) global; the rope bases differ per layer type and the
# global layers carry linear rope scaling. transformers' Gemma 3 ignores attn_logit_softcapping, and so
# must we: the cap is set to show it.
GEMMA3_FEATURES = dict(sliding_window=8, sliding_window_pattern=2, rope_local_base_freq=100.0, rope_theta=20000.0,
                       rope_scaling={"rope_type": "linear", "factor": 2.0}, query_pre_attn_scalar=24,
                       attn_logit_softcapping=4.0, final_logit_softcapping=3.0)

test_gemma3 = model_conformance.make_suite("Gemma3ForCausalLM", transformers.Gemma3TextConfig, **GEMMA3_FEATURES)


# -- planted bugs: Gemma variants, each wrong in one way, served under their own architecture name ----
def _with_layers(cls, change):
    """A factory building `cls` and then calling change(model, hf_config, ctx)."""
    def factory(hf_config, ctx):
        model = gemma.build_model(cls, hf_config, ctx)
        change(model, hf_config, ctx)
        return model
    return factory


def _norms_without_one(model, hf_config, ctx):
    """Norm weights loaded as w - 1, so each norm scales by w where Gemma scales by 1 + w."""
    load = model.load_weights

    def load_minus_one(weights, strict=True):
        names = load(weights, strict)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.data.sub_(1.0)
        return names
    model.load_weights = load_minus_one


def _no_sliding_window(model, hf_config, ctx):
    for layer in model.model.layers:
        layer.self_attn.attn.info = dataclasses.replace(layer.self_attn.attn.info, sliding_window=0)


def _no_attention_softcap(model, hf_config, ctx):
    for layer in model.model.layers:
        layer.self_attn.attn.info = dataclasses.replace(layer.self_attn.attn.info, logit_softcap=0.0)


def _global_rope_everywhere(model, hf_config, ctx):
    theta, scaling = gemma_config.gemma3_rope(hf_config, gemma_config.FULL)
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.rotary_emb = RotaryEmbedding(attn.head_dim, attn.head_dim, hf_config.max_position_embeddings, theta,
                                          scaling, True, ctx)


PLANTED = {
    "NormsWithoutOneGemma2": _with_layers(gemma.Gemma2ForCausalLM, _norms_without_one),
    "NoSlidingWindowGemma2": _with_layers(gemma.Gemma2ForCausalLM, _no_sliding_window),
    "NoAttentionSoftcapGemma2": _with_layers(gemma.Gemma2ForCausalLM, _no_attention_softcap),
    "GlobalRopeEverywhereGemma3": _with_layers(gemma.Gemma3ForCausalLM, _global_rope_everywhere),
}


class PlantedBugs:
    @hookimpl
    def backplane_register_models(self, register):
        for architecture, factory in PLANTED.items():
            register(ModelSpec(architecture=architecture, factory=factory, description="a planted bug"))


@pytest.mark.parametrize("architecture", sorted(PLANTED))
def test_the_gemma_suite_fails_on_a_planted_bug(architecture, tmp_path):
    gemma3 = architecture.endswith("Gemma3")
    config_class = transformers.Gemma3TextConfig if gemma3 else transformers.Gemma2Config
    reference = save_reference(architecture, config_class, 0, tmp_path, GEMMA3_FEATURES if gemma3 else GEMMA_FEATURES)
    with pytest.raises(AssertionError, match="transformers"):
        check_model(reference, "greedy", 0, plugins=[PlantedBugs()])
