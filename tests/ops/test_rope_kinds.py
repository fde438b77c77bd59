"""The longrope and dynamic rope kinds against transformers' rope init functions, and their bad input."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from backplane.models import rope_settings
from backplane.ops.rope import build_cos_sin_cache, rope_attention_factor, rope_inv_freq

SHORT, LONG = [1.0, 1.5, 3.0, 6.0], [2.0, 4.0, 8.0, 16.0]
LONGROPE = {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG}


def _phi3_rotary(max_pos: int, original: int, **scaling):
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = Phi3Config(hidden_size=64, num_attention_heads=4, max_position_embeddings=max_pos, pad_token_id=None,
                        original_max_position_embeddings=original, partial_rotary_factor=0.5,
                        rope_scaling={**LONGROPE, **scaling})
    _, params, _ = rope_settings(config)
    return Phi3RotaryEmbedding(config), params


def _assert_cache_is(cache: torch.Tensor, rotary, positions: torch.Tensor) -> None:
    cos, sin = rotary(torch.zeros(1), positions[None])  # [1, P, 8]: halves repeated
    torch.testing.assert_close(cache[positions], torch.cat((cos[0, :, :4], sin[0, :, :4]), -1), rtol=1e-6, atol=1e-6)


def test_longrope_long_factors_past_the_original_context():
    rotary, params = _phi3_rotary(512, 16)
    cache = build_cos_sin_cache(8, 512, 10000.0, params)
    _assert_cache_is(cache, rotary, torch.tensor([0, 1, 15, 16, 17, 300, 511]))  # max 511 >= 16: long in transformers
    assert rotary.attention_scaling == pytest.approx(math.sqrt(1 + math.log(32) / math.log(16)))


def test_longrope_short_factors_within_the_original_context():
    rotary, params = _phi3_rotary(64, 64)
    cache = build_cos_sin_cache(8, 64, 10000.0, params)
    _assert_cache_is(cache, rotary, torch.tensor([0, 1, 7, 40, 63]))
    assert not torch.allclose(cache, build_cos_sin_cache(8, 64, 10000.0))  # the short factors change it


def test_longrope_given_factor_and_attention_factor():
    rotary, params = _phi3_rotary(512, 16, attention_factor=1.25)
    _assert_cache_is(build_cos_sin_cache(8, 512, 10000.0, params), rotary, torch.tensor([3, 200]))
    assert rope_attention_factor({**LONGROPE, "original_max_position_embeddings": 16, "factor": 4.0}, 512) == \
        pytest.approx(math.sqrt(1 + math.log(4) / math.log(16)))


def test_dynamic_is_transformers_within_the_context():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "dynamic", "factor": 4.0}
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=256, rope_scaling=scaling)
    want, factor = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=256)
    torch.testing.assert_close(rope_inv_freq(16, 10000.0, scaling, 256), want, rtol=1e-6, atol=0)
    assert factor == 1.0 and rope_attention_factor(scaling, 256) == 1.0


def test_rope_settings_copies_the_original_context_from_a_4x_config():
    config = SimpleNamespace(rope_theta=10000.0, rope_scaling={"type": "su", "short_factor": SHORT, "long_factor": LONG},
                             original_max_position_embeddings=4096)
    _, scaling, _ = rope_settings(config)
    assert scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == 4096
    assert "rope_type" not in config.rope_scaling  # the config's own dict is left alone


@pytest.mark.parametrize("scaling, max_position, message", [
    ({**LONGROPE, "long_factor": [1.0, 2.0], "original_max_position_embeddings": 16}, 512, r"long_factor: expected a list of 4 numbers \(rotary_dim // 2\), got \[1\.0, 2\.0\]"),
    ({**LONGROPE, "short_factor": None, "original_max_position_embeddings": 16}, 16, "short_factor: expected a list of 4 numbers"),
    (LONGROPE, 512, "expected 'original_max_position_embeddings' for longrope"),
    ({**LONGROPE, "original_max_position_embeddings": 16}, None, "max_position: expected the context length"),
])
def test_bad_longrope_is_named(scaling, max_position, message):
    with pytest.raises(ValueError, match=message):
        rope_inv_freq(8, 10000.0, scaling, max_position)


@pytest.mark.parametrize("context, factors", [(16, SHORT), (17, LONG)])
def test_longrope_switches_one_past_the_original_context(context, factors):
    """transformers takes the long factors once the sequence is longer than the original context."""
    scaling = {**LONGROPE, "original_max_position_embeddings": 16}
    base = rope_inv_freq(8, 10000.0)
    torch.testing.assert_close(rope_inv_freq(8, 10000.0, scaling, context), base / torch.tensor(factors))
    rotary, _ = _phi3_rotary(context, 16)
    _assert_cache_is(build_cos_sin_cache(8, context, 10000.0, scaling), rotary, torch.arange(context))
