"""backplane-olmo2: OLMo 2 (`Olmo2ForCausalLM`) as a backplane model plugin."""

from backplane import ModelSpec, hookimpl

BACKPLANE_PLUGIN_API = "1.1"


def _make(hf_config, ctx):
    from backplane_olmo2.model import Olmo2ForCausalLM  # torch and the layers load only when built

    return Olmo2ForCausalLM(hf_config, ctx)


@hookimpl
def backplane_register_models(register):
    register(ModelSpec(architecture="Olmo2ForCausalLM", factory=_make,
                       description="OLMo 2: post-norms, q/k RMSNorm over all heads"))
