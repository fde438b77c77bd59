"""LoRA on a MoE model: adapters of the attention projections serve (equal to transformers with the
adapter merged); an adapter of the experts' weights (Mixtral's w1/w2/w3, Qwen's experts.N.gate_proj,
Qwen2-MoE's shared expert) is refused in one line when the engine starts."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers
from safetensors.torch import save_file

from backplane import Engine, SamplingParams
from backplane.testing.model_conformance import ENGINE_ARGS, Reference, assert_matches, random_prompts, save_reference

QWEN3_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, num_hidden_layers=2,
                 norm_topk_prob=True)
QWEN2_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                 num_hidden_layers=2, mlp_only_layers=[1])
MIXTRAL = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48, num_hidden_layers=2)


def test_lora_on_attention_matches_the_merged_model(tmp_path):
    from peft import LoraConfig, get_peft_model

    base = save_reference("Qwen3MoeForCausalLM", transformers.Qwen3MoeConfig, 2, tmp_path / "base", QWEN3_MOE)
    torch.manual_seed(3)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        init_lora_weights=False)
    peft_model = get_peft_model(copy.deepcopy(base.model), config)
    with torch.no_grad():  # deltas visible in the logits
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(0.5 * torch.randn_like(param) / param.shape[-1] ** 0.5)
    peft_model.save_pretrained(tmp_path / "attn")
    merged = Reference(peft_model.merge_and_unload().eval(), base.path, steps=6)
    base.steps = 6
    engine = Engine(str(base.path), lora_paths=[f"attn={tmp_path / 'attn'}"], **ENGINE_ARGS)
    prompts = random_prompts(2, (13, 13), base.model.config.vocab_size)
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    with_lora, without = engine.generate(input_ids=prompts, sampling_params=params, lora=["attn", None])
    assert with_lora.error is None and without.error is None
    adapted, plain = merged.greedy(prompts[0])[1], base.greedy(prompts[0])[1]
    assert (adapted - plain).abs().max() > 0.05, "the adapter barely moves the logits; the case tests nothing"
    assert_matches("LoRA on attention, adapted request", prompts[0], with_lora, merged)
    assert_matches("LoRA on attention, base request in the same batch", prompts[1], without, base)


def _adapter(path, targets: list[str], tensors: dict[str, tuple[int, int]]) -> str:
    """A PEFT adapter directory of rank 2 with lora_A [2, in] / lora_B [out, 2] for each module of layer 0."""
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 2,
                                                          "target_modules": targets}))
    weights = {}
    for module, (in_features, out_features) in tensors.items():
        weights[f"base_model.model.model.layers.0.{module}.lora_A.weight"] = 0.1 * torch.randn(2, in_features)
        weights[f"base_model.model.model.layers.0.{module}.lora_B.weight"] = 0.1 * torch.randn(out_features, 2)
    save_file(weights, str(path / "adapter_model.safetensors"))
    return f"experts={path}"


REFUSED = {  # case: (architecture, config class, overrides, target modules, adapted modules of layer 0, named)
    "mixtral_w1": ("MixtralForCausalLM", transformers.MixtralConfig, MIXTRAL, ["q_proj", "w1"],
                   {"self_attn.q_proj": (64, 64), "block_sparse_moe.experts.0.w1": (64, 48)}, "w1"),
    "qwen2_moe_experts": ("Qwen2MoeForCausalLM", transformers.Qwen2MoeConfig, QWEN2_MOE, ["q_proj", "gate_proj"],
                          {"self_attn.q_proj": (64, 64), "mlp.experts.0.gate_proj": (64, 32)}, "experts.0.gate_proj"),
    "qwen2_moe_shared_expert": ("Qwen2MoeForCausalLM", transformers.Qwen2MoeConfig, QWEN2_MOE, ["up_proj"],
                                {"mlp.shared_expert.up_proj": (64, 48)}, "shared_expert.up_proj"),
    "qwen3_moe_experts": ("Qwen3MoeForCausalLM", transformers.Qwen3MoeConfig, QWEN3_MOE, ["down_proj"],
                          {"mlp.experts.1.down_proj": (32, 64)}, "down_proj"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_lora_on_experts_is_refused_in_one_line(case, tmp_path):
    architecture, config_class, overrides, targets, tensors, named = REFUSED[case]
    base = save_reference(architecture, config_class, 0, tmp_path / "base", overrides)
    lora = _adapter(tmp_path / "adapter", targets, tensors)
    with pytest.raises(ValueError) as refused:
        Engine(str(base.path), lora_paths=[lora], **ENGINE_ARGS)
    message = str(refused.value)
    assert "\n" not in message and "LoRA adapter 'experts'" in message and named in message, message
