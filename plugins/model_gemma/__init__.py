"""Model plugin "model_gemma": Gemma 2 and Gemma 3 (text), built only from backplane's public model API."""

from backplane import ModelSpec, hookimpl

DESCRIPTIONS = {
    "Gemma2ForCausalLM": "Gemma 2 (sliding window every other layer, attention and final logit soft-cap)",
    "Gemma3ForCausalLM": "Gemma 3 text (q/k norms, local/global rope bases, 5:1 sliding window)",
}


def _factory(architecture: str):
    def factory(hf_config, ctx):
        from backplane.plugins.model_gemma import model

        return model.build_model(getattr(model, architecture), hf_config, ctx)

    return factory


@hookimpl
def backplane_register_models(register):
    for architecture, description in DESCRIPTIONS.items():
        register(ModelSpec(architecture=architecture, factory=_factory(architecture), description=description))
