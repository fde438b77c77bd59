"""Gemma 2 on two CPU ranks (gloo) gives transformers' greedy tokens: the plugin is tensor-parallel
through the public layers alone (heads, gate/up rows and the vocabulary split over the ranks)."""

from __future__ import annotations

import transformers

from backplane import Engine, SamplingParams
from backplane.testing.model_conformance import ENGINE_ARGS, assert_matches, random_prompts, save_reference

FEATURES = dict(sliding_window=8, attn_logit_softcapping=4.0, final_logit_softcapping=3.0, query_pre_attn_scalar=24,
                num_hidden_layers=2, num_key_value_heads=2)


def test_gemma2_tp2_matches_transformers(tmp_path):
    reference = save_reference("Gemma2ForCausalLM", transformers.Gemma2Config, 3, tmp_path, FEATURES)
    reference.steps = 4
    prompts = random_prompts(3, (20, 13), reference.model.config.vocab_size)
    engine = Engine(str(tmp_path), tp_size=2, max_total_tokens=512, **ENGINE_ARGS)
    try:
        params = SamplingParams(max_new_tokens=reference.steps, temperature=0.0, ignore_eos=True)
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        assert (engine.runner.model.num_heads, engine.runner.model.num_kv_heads) == (2, 1)  # this rank's share
    finally:
        engine.shutdown()
    for n, (prompt, out) in enumerate(zip(prompts, outs)):
        assert out.error is None, out.error
        assert_matches(f"tensor parallel 2, request {n}", prompt, out, reference)
