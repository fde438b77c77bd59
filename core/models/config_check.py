"""Checking a model directory's config.json before transformers reads it.

transformers accepts many bad values silently (a string hidden size, zero heads) and the model
then fails deep inside construction or the first forward. Each field the Llama family reads is
checked here when present; the error is one line naming the file, the field, the value and what
was expected. Two checks need the run's settings and are called before anything is built:
`check_tensor_parallel` (the heads divide over --tp-size, before workers start) and
`check_model_memory` (the weights and the rotary cache fit the device's free memory).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

# Fields that must be integers >= 1 when present (transformers' defaults fill absent ones).
POSITIVE_INTS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                 "num_hidden_layers", "vocab_size", "max_position_embeddings")
OPTIONAL_POSITIVE_INTS = ("head_dim", "sliding_window")  # may also be null
ZERO_IS_OFF = ("sliding_window",)  # 0: no window (transformers 5 writes it for a Qwen2-MoE without use_sliding_window)
POSITIVE_NUMBERS = ("rms_norm_eps", "rope_theta")
BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias")


def read_config_json(file: Path) -> dict[str, Any]:
    """The parsed and checked config.json; ValueError (one line) on any bad field."""
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"model config '{file}': expected JSON, got a parse error: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"model config '{file}': expected a JSON object, got {type(raw).__name__}")
    problem = config_problem(raw)
    if problem:
        raise ValueError(f"model config '{file}': {problem}")
    return raw


def config_problem(raw: dict[str, Any]) -> str | None:
    """The first bad field of a config dict as "field 'x' = v: expected ...", or None."""
    for check in (_architectures, _integers, _numbers, _bools, _head_layout, _rope_factor):
        problem = check(raw)
        if problem:
            return problem
    return None


def _bad(name: str, value: Any, expected: str) -> str:
    return f"field {name!r} = {value!r}: expected {expected}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _architectures(raw: dict[str, Any]) -> str | None:
    value = raw.get("architectures")
    if value is None:
        return None
    if not isinstance(value, list) or not value or not all(isinstance(a, str) and a for a in value):
        return _bad("architectures", value, 'a non-empty list of class names such as ["LlamaForCausalLM"]')
    return None


def _integers(raw: dict[str, Any]) -> str | None:
    for name in POSITIVE_INTS + OPTIONAL_POSITIVE_INTS:
        if name not in raw or (raw[name] is None and name in OPTIONAL_POSITIVE_INTS):
            continue
        value = raw[name]
        if not _is_int(value) or value < (0 if name in ZERO_IS_OFF else 1):
            least = "an integer >= 0 (0: off)" if name in ZERO_IS_OFF else "an integer >= 1"
            return _bad(name, value, least + (" or null" if name in OPTIONAL_POSITIVE_INTS else ""))
    return None


def _numbers(raw: dict[str, Any]) -> str | None:
    for name in POSITIVE_NUMBERS:
        value = raw.get(name)
        if value is None:
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            return _bad(name, value, "a finite number > 0")
    return None


def _bools(raw: dict[str, Any]) -> str | None:
    for name in BOOLS:
        if name in raw and not isinstance(raw[name], bool):
            return _bad(name, raw[name], "true or false")
    return None


def _head_layout(raw: dict[str, Any]) -> str | None:
    heads, kv_heads = raw.get("num_attention_heads"), raw.get("num_key_value_heads")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        return _bad("num_key_value_heads", kv_heads, f"a divisor of num_attention_heads {heads}")
    hidden = raw.get("hidden_size")
    if raw.get("head_dim") is None and hidden is not None and heads is not None and hidden % heads:
        return _bad("hidden_size", hidden, f"a multiple of num_attention_heads {heads} (or set head_dim)")
    return None


def _rope_factor(raw: dict[str, Any]) -> str | None:
    for name in ("rope_scaling", "rope_parameters"):
        params = raw.get(name)
        if not isinstance(params, dict) or "factor" not in params:
            continue
        factor = params["factor"]
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not math.isfinite(factor) or factor <= 0:
            return _bad(f"{name}.factor", factor, "a finite number > 0 (a JSON number, not a string)")
    return None


def check_tensor_parallel(config: Any, tp_size: int) -> None:
    """Refuse a --tp-size the model's heads or MLP do not divide by, in one line naming the field;
    called before any worker starts. KV heads fewer than tp_size are replicated (tp_size a multiple)."""
    if tp_size == 1:
        return
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for field, value in (("num_attention_heads", heads), ("intermediate_size", config.intermediate_size)):
        if value % tp_size:
            raise ValueError(f"--tp-size {tp_size}: the model's {field} {value} is not a multiple of it; "
                             f"expected a divisor of {value}")
    if kv_heads % tp_size and tp_size % kv_heads:
        raise ValueError(f"--tp-size {tp_size}: the model's num_key_value_heads {kv_heads} neither divides "
                         "by it nor divides it; expected a divisor or a multiple of num_key_value_heads")


def model_memory_terms(config: Any, dtype_bytes: int, tp_size: int = 1) -> dict[str, int]:
    """Bytes per rank the model needs before any KV, by the config field that drives each term."""
    hidden, vocab = config.hidden_size, config.vocab_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    attn = hidden * head_dim * (2 * config.num_attention_heads + 2 * kv_heads)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    terms = {"vocab_size": (1 if tied else 2) * vocab * hidden * dtype_bytes // tp_size}
    experts_field = next((f for f in ("num_local_experts", "num_experts") if getattr(config, f, None)), None)
    if experts_field is None:
        layer = attn + 3 * hidden * config.intermediate_size
        terms["num_hidden_layers"] = config.num_hidden_layers * layer * dtype_bytes // tp_size
    else:  # a MoE model: every expert's gate/up/down (sharded), the shared expert, the replicated router
        experts = getattr(config, experts_field)
        inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        shared = getattr(config, "shared_expert_intermediate_size", None) or 0
        moe = 3 * hidden * (experts * inter + shared) // tp_size + hidden * experts
        terms["num_hidden_layers"] = config.num_hidden_layers * attn * dtype_bytes // tp_size
        terms[experts_field] = config.num_hidden_layers * moe * dtype_bytes
    # one fp32 cos/sin cache shared by every layer: [max_position, head_dim]
    terms["max_position_embeddings"] = config.max_position_embeddings * head_dim * 4
    return terms


def check_model_memory(config: Any, dtype_bytes: int, free_bytes: int, device: str, tp_size: int = 1) -> None:
    """Refuse a model whose weights and rotary cache exceed `free_bytes`, in one line naming the
    field that costs the most; called before the model is built."""
    terms = model_memory_terms(config, dtype_bytes, tp_size)
    need = sum(terms.values())
    if need <= free_bytes:
        return
    field = max(terms, key=terms.get)
    raise ValueError(f"model config: {field} {getattr(config, field)} makes the model need about "
                     f"{need / 2**30:,.1f} GiB of {device} memory ({terms[field] / 2**30:,.1f} GiB from {field}) "
                     f"but {free_bytes / 2**30:,.1f} GiB is free; expected a model that fits")
