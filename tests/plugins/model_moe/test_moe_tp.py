"""MoE models on two CPU ranks (gloo) give transformers' greedy tokens and logprobs, as one rank does:
each rank keeps half of every expert's intermediate dimension (and of the shared expert's and the
dense layer's), the partial sums are all-reduced once per MoE block."""

from __future__ import annotations

import pytest
import transformers

from backplane import Engine, SamplingParams
from backplane.testing.model_conformance import ENGINE_ARGS, assert_matches, random_prompts, save_reference

CASES = {
    # shared expert (gated), a dense layer, no renormalisation: every TP-split piece of the block
    "Qwen2MoeForCausalLM": (transformers.Qwen2MoeConfig, dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        mlp_only_layers=[1], num_hidden_layers=2, num_key_value_heads=2)),
    "MixtralForCausalLM": (transformers.MixtralConfig, dict(
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=48, num_hidden_layers=2,
        num_key_value_heads=2)),
}


@pytest.mark.parametrize("architecture", sorted(CASES))
def test_tp2_matches_transformers(architecture, tmp_path):
    config_class, overrides = CASES[architecture]
    reference = save_reference(architecture, config_class, 6, tmp_path, overrides)
    reference.steps = 4
    prompts = random_prompts(6, (21, 9), reference.model.config.vocab_size)
    engine = Engine(str(tmp_path), tp_size=2, max_total_tokens=512, **ENGINE_ARGS)
    try:
        params = SamplingParams(max_new_tokens=reference.steps, temperature=0.0, ignore_eos=True)
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        info = next(m.moe_info for m in engine.runner.model.modules() if hasattr(m, "moe_info"))
        assert (info.tp_size, info.intermediate_size_per_partition) == (2, info.intermediate_size // 2)
    finally:
        engine.shutdown()
    for n, (prompt, out) in enumerate(zip(prompts, outs)):
        assert out.error is None, out.error
        assert_matches(f"{architecture} tensor parallel 2, request {n}", prompt, out, reference)
