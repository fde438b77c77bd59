"""YaRN rope scaling: the cos/sin cache against transformers' rope init function over Qwen- and
DeepSeek-style configs, its bad input, and tiny Qwen2/Qwen3 models with yarn against transformers."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from backplane.ops.rope import build_cos_sin_cache, rope_attention_factor, rope_inv_freq
from backplane.testing import model_conformance

# (name, head_dim, theta, max_position_embeddings, rope parameters): a cache of max_position_embeddings rows
YARN_CASES = [
    ("qwen", 128, 1_000_000.0, 4096, {"factor": 4.0, "original_max_position_embeddings": 32768}),
    ("qwen-short-original", 64, 10000.0, 2048, {"factor": 4.0, "original_max_position_embeddings": 512}),
    ("deepseek-mscale", 64, 10000.0, 4096, {"factor": 40.0, "original_max_position_embeddings": 4096,
                                            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
    ("deepseek-mscale-ratio", 64, 10000.0, 4096, {"factor": 40.0, "original_max_position_embeddings": 4096,
                                                  "mscale": 0.707, "mscale_all_dim": 1.0}),
    ("deepseek-v3-no-factor", 32, 10000.0, 8192, {"factor": None, "original_max_position_embeddings": 1024}),
    ("attention-factor-untruncated", 32, 500000.0, 1024, {"factor": 8.0, "original_max_position_embeddings": 128,
                                                          "attention_factor": 0.9, "beta_fast": 16.0,
                                                          "beta_slow": 2.0, "truncate": False}),
    ("partial-rotary", 64, 10000.0, 1024, {"factor": 2.0, "original_max_position_embeddings": 256,
                                           "partial_rotary_factor": 0.5}),
]


def _transformers_yarn(head_dim: int, theta: float, max_pos: int, params: dict) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                                      max_position_embeddings=max_pos,
                                      rope_parameters={"rope_type": "yarn", "rope_theta": theta, **params})
    return ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")


@pytest.mark.parametrize("name, head_dim, theta, max_pos, params", YARN_CASES, ids=[c[0] for c in YARN_CASES])
def test_yarn_cache_matches_transformers(name, head_dim, theta, max_pos, params):
    want_inv_freq, want_factor = _transformers_yarn(head_dim, theta, max_pos, params)
    scaling = {"rope_type": "yarn", **params}
    rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    torch.testing.assert_close(rope_inv_freq(rotary_dim, theta, scaling, max_pos), want_inv_freq, rtol=1e-6, atol=0)
    assert rope_attention_factor(scaling, max_pos) == pytest.approx(want_factor, rel=1e-12)

    cache = build_cos_sin_cache(rotary_dim, max_pos, theta, scaling)
    positions = torch.tensor([0, 1, 7, 100, max_pos // 2 + 3, max_pos - 1])
    freqs = positions.float()[:, None] * want_inv_freq[None]  # as transformers' rotary forward: [P, rotary_dim // 2]
    torch.testing.assert_close(cache[positions], torch.cat((freqs.cos(), freqs.sin()), -1) * want_factor,
                               rtol=1e-5, atol=1e-5)
    plain = build_cos_sin_cache(rotary_dim, max_pos, theta)
    assert not torch.allclose(cache, plain)  # yarn really changes the frequencies


def test_yarn_attention_factors_are_the_papers():
    qwen = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert rope_attention_factor(qwen, 131072) == pytest.approx(0.1 * math.log(4.0) + 1)
    same = {**qwen, "mscale": 0.707, "mscale_all_dim": 0.707}  # DeepSeek-V2: equal scales cancel
    assert rope_attention_factor(same, 131072) == pytest.approx(1.0)
    assert rope_attention_factor({**qwen, "factor": 1.0}, 32768) == 1.0


@pytest.mark.parametrize("scaling, max_position, message", [
    ({"rope_type": "yarn", "factor": 4.0}, 512, "expected 'original_max_position_embeddings' for yarn"),
    ({"rope_type": "yarn", "factor": "4", "original_max_position_embeddings": 128}, 512,
     r"factor: expected a positive number for yarn, got '4'"),
    ({"rope_type": "yarn", "factor": 0, "original_max_position_embeddings": 128}, 512,
     "factor: expected a positive number for yarn, got 0"),
    ({"rope_type": "yarn", "original_max_position_embeddings": 128}, None,
     "max_position: expected the context length for rope type 'yarn' without 'factor'"),
])
def test_bad_yarn_is_named(scaling, max_position, message):
    with pytest.raises(ValueError, match=message):
        rope_inv_freq(16, 10000.0, scaling, max_position)


# The models against transformers (fp32, CPU). original 128 of a 512-token context, so the ramp sits
# inside the 8 frequencies of head_dim 16 and the attention factor is not 1.
QWEN_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
test_qwen2_yarn = model_conformance.make_suite("Qwen2ForCausalLM", transformers.Qwen2Config, seeds=(0,),
                                               checks=("greedy", "chunked_prefill"), rope_scaling=QWEN_YARN)
test_qwen3_yarn_mscale = model_conformance.make_suite(
    "Qwen3ForCausalLM", transformers.Qwen3Config, seeds=(1,), checks=("greedy",),
    rope_scaling={**QWEN_YARN, "beta_fast": 8, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.5})
