"""Model plugin "Phi3ForCausalLM": Microsoft's Phi-3 (and Phi-3.5 / Phi-4-mini text) decoders.

Fused `qkv_proj` / `gate_up_proj` checkpoints, partial rotary, LongRoPE scaling (short and long
factors), sliding-window attention when the config sets one. Built only from the public model API.
"""

from backplane import ModelSpec, hookimpl


def _factory(hf_config, ctx):
    from backplane.plugins.model_phi3.model import build_model

    return build_model(hf_config, ctx)


@hookimpl
def backplane_register_models(register):
    register(ModelSpec(architecture="Phi3ForCausalLM", factory=_factory,
                       description="Phi-3 / Phi-3.5 / Phi-4-mini (fused qkv and gate_up, LongRoPE)"))
