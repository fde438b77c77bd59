"""Reading Llama-family settings from a transformers config, across transformers 4.x and 5.x."""

from __future__ import annotations

from typing import Any


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def num_kv_heads_of(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def rope_settings(config) -> tuple[float, dict[str, Any] | None, float]:
    """(rope_theta, rope scaling dict or None, partial_rotary_factor).

    transformers 5 keeps everything in `rope_parameters`; 4.x has `rope_theta` and `rope_scaling`, and
    Phi-3's `original_max_position_embeddings` beside them: a longrope (or 4.x "su") scaling dict gets
    it copied in when it lacks one, with its type spelt `rope_type: longrope`.
    """
    params = getattr(config, "rope_parameters", None)
    if params and "rope_theta" not in params and any(isinstance(v, dict) for v in params.values()):
        raise ValueError(
            f"rope_parameters: expected one rope for all layers in the Llama family, got {params}"
        )
    scaling = _with_longrope_keys(params or getattr(config, "rope_scaling", None), config)
    theta = (params or {}).get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
    partial = (params or {}).get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0
    return float(theta), scaling, float(partial)


def _with_longrope_keys(scaling: dict[str, Any] | None, config) -> dict[str, Any] | None:
    kind = scaling and (scaling.get("rope_type") or scaling.get("type"))
    if kind not in ("longrope", "su"):
        return scaling
    original = scaling.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
    return {**scaling, "rope_type": "longrope", "original_max_position_embeddings": original}


def sliding_window_of(config, layer_id: int) -> int:
    """The layer's attention window (0 = full attention).

    `layer_types` (transformers 5 Qwen2/Qwen3) decides per layer; otherwise Qwen's
    `use_sliding_window` / `max_window_layers` (4.x), otherwise `sliding_window` (Mistral).
    """
    window = getattr(config, "sliding_window", None) or 0
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_id] == "sliding_attention" else 0
    use = getattr(config, "use_sliding_window", None)
    if use is None:
        return window
    return window if use and layer_id >= getattr(config, "max_window_layers", 0) else 0


# Keys backplane's Llama-family layers read, per architecture whose transformers class does not read
# them: (key, the value that means "off"). The loader resets them so the model is the one transformers
# builds (a Llama config with a sliding_window attends to everything in transformers, and so here).
_SLIDING_KEYS = (("sliding_window", None), ("use_sliding_window", None), ("layer_types", None))
_SOFTCAP = (("final_logit_softcapping", None), ("attn_logit_softcapping", None))
IGNORED_KEYS: dict[str, tuple[tuple[str, Any], ...]] = {
    "LlamaForCausalLM": _SLIDING_KEYS + _SOFTCAP,
    "MistralForCausalLM": _SOFTCAP + (("use_sliding_window", None), ("layer_types", None),
                                      ("attention_bias", False), ("mlp_bias", False)),
    "Qwen2ForCausalLM": _SOFTCAP + (("attention_bias", False), ("mlp_bias", False)),
    "Qwen3ForCausalLM": _SOFTCAP + (("mlp_bias", False),),
}


def reset_ignored_keys(config) -> dict[str, Any]:
    """Reset the keys transformers ignores for `config`'s architecture; returns those that were on
    (key -> the value found), for the caller to warn about."""
    architectures = getattr(config, "architectures", None) or []
    found = {}
    for key, off in IGNORED_KEYS.get(architectures[0] if architectures else "", ()):
        value = getattr(config, key, off)
        if _changes_model(value):
            found[key] = value
            setattr(config, key, off)
    return found


def _changes_model(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return "sliding_attention" in value
    return bool(value)
