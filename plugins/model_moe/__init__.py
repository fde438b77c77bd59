"""Model plugin "model_moe": Mixtral, Qwen2-MoE and Qwen3-MoE, built only from backplane's public model API.

Each decoder layer's MLP is the core's `FusedMoE` (backplane.layers): the router stays in the model's
dtype and is never quantized, the experts run on the model's MoE backend (`--moe-backend`).
"""

from backplane import ModelSpec, hookimpl

DESCRIPTIONS = {
    "MixtralForCausalLM": "Mixtral (top-k experts, renormalised router)",
    "Qwen2MoeForCausalLM": "Qwen2-MoE / Qwen1.5-MoE (shared expert with a sigmoid gate, dense layers)",
    "Qwen3MoeForCausalLM": "Qwen3-MoE (q/k norms, norm_topk_prob, dense layers)",
}


def _factory(architecture: str):
    def factory(hf_config, ctx):
        from backplane.plugins.model_moe import model

        return model.build_model(getattr(model, architecture), hf_config, ctx)

    return factory


@hookimpl
def backplane_register_models(register):
    for architecture, description in DESCRIPTIONS.items():
        register(ModelSpec(architecture=architecture, factory=_factory(architecture), description=description))
