"""The Gemma plugin's parts: GeluAndMul, the config readers, the checkpoint layout, the import boundary."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers

import backplane.plugins.model_gemma as model_gemma
from backplane.layers import GeluAndMul
from backplane.models import ModelContext
from backplane.ops import native
from backplane.plugins.model_gemma import config as gemma_config
from backplane.plugins.model_gemma.model import Gemma2ForCausalLM, Gemma3ForCausalLM
from backplane.plugins.model_gemma.norm import GemmaRMSNorm
from backplane.testing.boundary import check_plugin_imports

PLUGIN_DIR = Path(model_gemma.__file__).parent
OPS = SimpleNamespace(ops=SimpleNamespace(gelu_and_mul=native.gelu_and_mul))
SMALL = dict(hidden_size=32, intermediate_size=48, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
             vocab_size=50, num_hidden_layers=3)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("tokens", [1, 17])
def test_gelu_and_mul_is_geglu(approximate, tokens):
    x = torch.randn(tokens, 2 * 24)
    gate, up = x[:, :24], x[:, 24:]
    expected = 0.5 * gate * (1 + torch.erf(gate / 2**0.5)) * up if approximate == "none" else (
        0.5 * gate * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate**3))) * up)
    torch.testing.assert_close(GeluAndMul(OPS, approximate)(x), expected, atol=1e-6, rtol=1e-5)


def test_gelu_and_mul_refuses_an_unknown_approximation():
    with pytest.raises(ValueError, match=r"GeluAndMul approximate: expected one of \('none', 'tanh'\), got 'fast'"):
        GeluAndMul(OPS, "fast")


def test_gemma_norm_scales_by_one_plus_weight():
    norm = GemmaRMSNorm(8, 1e-6)
    norm.weight.data = torch.linspace(-0.5, 0.5, 8)
    x = torch.randn(3, 8)
    expected = x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * (1 + norm.weight)
    torch.testing.assert_close(norm(x), expected)


def test_layer_types_follow_the_config_or_the_pattern():
    assert gemma_config.layer_types(transformers.Gemma2Config(**SMALL)) == [
        "sliding_attention", "full_attention", "sliding_attention"]
    old_gemma2 = SimpleNamespace(num_hidden_layers=4, layer_types=None)  # transformers 4.x: no layer_types
    assert gemma_config.layer_types(old_gemma2) == ["sliding_attention", "full_attention"] * 2
    old_gemma3 = SimpleNamespace(num_hidden_layers=7, layer_types=None, sliding_window_pattern=6)
    assert gemma_config.layer_types(old_gemma3) == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]


def test_bad_layer_types_are_refused():
    bad = SimpleNamespace(num_hidden_layers=2, layer_types=["sliding_attention", "chunked_attention"])
    with pytest.raises(ValueError, match="layer_types: expected 2 of 'sliding_attention'/'full_attention'"):
        gemma_config.layer_types(bad)


def test_an_unknown_activation_is_refused():
    with pytest.raises(ValueError, match=r"hidden_activation: expected one of \['gelu', .*\] for Gemma, got 'silu'"):
        gemma_config.gelu_approximate(SimpleNamespace(hidden_activation="silu"))


def test_bidirectional_attention_is_refused():
    with pytest.raises(ValueError, match="use_bidirectional_attention: expected False"):
        gemma_config.sliding_window(SimpleNamespace(use_bidirectional_attention=True, sliding_window=8), "full_attention")


def test_gemma3_rope_bases_per_layer_type():
    new = transformers.Gemma3TextConfig(**SMALL, rope_local_base_freq=100.0, rope_theta=20000.0,
                                        rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert gemma_config.gemma3_rope(new, "sliding_attention") == (100.0, {"rope_type": "default"})
    assert gemma_config.gemma3_rope(new, "full_attention") == (20000.0, {"rope_type": "linear", "factor": 2.0})
    old = SimpleNamespace(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0})
    assert gemma_config.gemma3_rope(old, "sliding_attention") == (1e4, None)
    assert gemma_config.gemma3_rope(old, "full_attention") == (1e6, {"rope_type": "linear", "factor": 8.0})


@pytest.mark.parametrize("config_class, model_class", [(transformers.Gemma2Config, Gemma2ForCausalLM),
                                                      (transformers.Gemma3TextConfig, Gemma3ForCausalLM)])
@pytest.mark.parametrize("tied", [True, False])
def test_checkpoint_shapes_are_transformers_state_dict(config_class, model_class, tied):
    config = config_class(**SMALL, tie_word_embeddings=tied)
    reference = transformers.AutoModelForCausalLM.from_config(config)
    expected = {name: tuple(t.shape) for name, t in reference.state_dict().items()}
    if tied:
        expected.pop("lm_head.weight")
    assert dict(gemma_config.gemma_checkpoint_shapes(config, model_class.qk_norm)) == expected


def test_gemma3_ignores_the_attention_softcap_as_transformers_does(caplog):
    config = transformers.Gemma3TextConfig(**SMALL, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    model = Gemma3ForCausalLM(config, ModelContext())
    assert {layer.self_attn.attn.info.logit_softcap for layer in model.model.layers} == {0.0}
    assert "Gemma3ForCausalLM: attn_logit_softcapping=50.0 is ignored" in caplog.text
    gemma2 = Gemma2ForCausalLM(transformers.Gemma2Config(**SMALL, attn_logit_softcapping=50.0), ModelContext())
    assert {layer.self_attn.attn.info.logit_softcap for layer in gemma2.model.layers} == {50.0}


def test_the_plugin_imports_only_public_modules():
    assert check_plugin_imports(PLUGIN_DIR, "backplane.plugins.model_gemma") == []


def test_a_planted_private_import_fails_the_boundary_check(tmp_path):
    copy = tmp_path / "model_gemma"
    copy.mkdir()
    for source in PLUGIN_DIR.glob("*.py"):
        (copy / source.name).write_text(source.read_text())
    with (copy / "norm.py").open("a") as f:
        f.write("from backplane.layers.norm import RMSNorm  # noqa\n")
    problems = check_plugin_imports(copy, "backplane.plugins.model_gemma")
    assert len(problems) == 1 and "backplane.layers.norm" in problems[0], problems
