"""The builtin plugin that registers the Llama-family models, like any other plugin would."""

from backplane.plugin.hookspecs import hookimpl
from backplane.plugin.registry import ModelSpec

_DESCRIPTIONS = {
    "LlamaForCausalLM": "Llama 2/3 (rope scaling: linear, llama3)",
    "MistralForCausalLM": "Mistral (sliding-window attention)",
    "Qwen2ForCausalLM": "Qwen2 / Qwen2.5 (q/k/v bias)",
    "Qwen3ForCausalLM": "Qwen3 (per-head q/k RMSNorm)",
}


def _factory(architecture: str):
    def factory(hf_config, ctx):
        from backplane.models import llama

        return llama.build_model(getattr(llama, architecture), hf_config, ctx)

    return factory


@hookimpl
def backplane_register_models(register):
    for architecture, description in _DESCRIPTIONS.items():
        register(ModelSpec(architecture=architecture, factory=_factory(architecture), description=description))
