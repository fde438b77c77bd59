"""Phi-3 (plugin model_phi3) passes the model conformance suite against transformers.Phi3Config."""

from __future__ import annotations

import transformers

from backplane.testing import model_conformance

PROMPT_FREE = dict(pad_token_id=None, bos_token_id=1, eos_token_id=2)  # the default pad id 32000 is past a tiny vocab
# head_dim 16, partial rotary 0.5: 8 rotary dims, 4 factors. With the context equal to the original
# one (512), both transformers and backplane use the short factors; the long ones are tested below.
SHORT_ROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.5, 3.0, 6.0], "long_factor": [2.0, 4.0, 8.0, 16.0]}

test_phi3 = model_conformance.make_suite("Phi3ForCausalLM", transformers.Phi3Config, **PROMPT_FREE)
test_phi3_longrope_short = model_conformance.make_suite(
    "Phi3ForCausalLM", transformers.Phi3Config, seeds=(2,), checks=("greedy", "chunked_prefill"),
    rope_scaling=SHORT_ROPE, partial_rotary_factor=0.5, original_max_position_embeddings=512, **PROMPT_FREE)
test_phi3_sliding_window = model_conformance.make_suite(
    "Phi3ForCausalLM", transformers.Phi3Config, seeds=(3,), checks=("greedy",), sliding_window=8, **PROMPT_FREE)
