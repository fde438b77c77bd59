"""What the Gemma layers read from a transformers Gemma2Config / Gemma3TextConfig, across 4.x and 5.x."""

from __future__ import annotations

from typing import Any

from backplane.models import llama_checkpoint_shapes

SLIDING, FULL = "sliding_attention", "full_attention"
# transformers' names of Gemma's activation -> GeluAndMul's `approximate`
GELU_KINDS = {"gelu_pytorch_tanh": "tanh", "gelu_tanh": "tanh", "gelu": "none"}
# Gemma 3's rope bases when a config names none (transformers' defaults)
DEFAULT_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}


def gelu_approximate(config) -> str:
    """GeluAndMul's `approximate` for the config's `hidden_activation` (or the older `hidden_act`)."""
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if act not in GELU_KINDS:
        raise ValueError(f"hidden_activation: expected one of {sorted(GELU_KINDS)} for Gemma, got {act!r}")
    return GELU_KINDS[act]


def layer_types(config) -> list[str]:
    """Each layer's "sliding_attention" or "full_attention".

    `layer_types` when the config has it; else every `sliding_window_pattern`-th layer is global
    (pattern 2 for Gemma 2, whose older configs alternate sliding and global from layer 0).
    """
    types = getattr(config, "layer_types", None)
    if types is not None:
        unknown = sorted(set(types) - {SLIDING, FULL})
        if unknown or len(types) != config.num_hidden_layers:
            raise ValueError(f"layer_types: expected {config.num_hidden_layers} of {SLIDING!r}/{FULL!r}, got {types}")
        return list(types)
    pattern = getattr(config, "sliding_window_pattern", None) or getattr(config, "_sliding_window_pattern", None) or 2
    return [SLIDING if (i + 1) % pattern else FULL for i in range(config.num_hidden_layers)]


def sliding_window(config, layer_type: str) -> int:
    """The window of a layer of this type (0 = full attention)."""
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention: expected False (causal decoding), got True")
    return int(config.sliding_window or 0) if layer_type == SLIDING else 0


def softcap(config, key: str) -> float:
    """`attn_logit_softcapping` or `final_logit_softcapping` as a float, 0.0 when off."""
    return float(getattr(config, key, None) or 0.0)


def gemma3_rope(config, layer_type: str) -> tuple[float, dict[str, Any] | None]:
    """(rope base, rope_scaling dict or None) of a Gemma 3 layer type.

    transformers 5 keeps one dict per layer type in `rope_parameters`; 4.x has `rope_theta` (global),
    `rope_local_base_freq` (sliding) and `rope_scaling` (global layers only).
    """
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type in params:
        entry = dict(params[layer_type] or {})
        return float(entry.pop("rope_theta", DEFAULT_THETA[layer_type])), entry or None
    if layer_type == SLIDING:
        return float(getattr(config, "rope_local_base_freq", None) or DEFAULT_THETA[SLIDING]), None
    return float(getattr(config, "rope_theta", None) or DEFAULT_THETA[FULL]), getattr(config, "rope_scaling", None)


def gemma_checkpoint_shapes(config, qk_norm: bool) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a Hugging Face Gemma 2/3 text checkpoint with its full shape: the Llama
    layout plus the feed-forward sandwich norms."""
    hidden = (config.hidden_size,)
    shapes = []
    for name, shape in llama_checkpoint_shapes(config, False, qk_norm):
        shapes.append((name, shape))
        if name.endswith(".post_attention_layernorm.weight"):
            prefix = name[: -len("post_attention_layernorm.weight")]
            shapes += [(f"{prefix}pre_feedforward_layernorm.weight", hidden),
                       (f"{prefix}post_feedforward_layernorm.weight", hidden)]
    return shapes
