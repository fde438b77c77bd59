"""Checking a model directory's config.json before transformers reads it.

transformers accepts many bad values silently (a string hidden size, zero heads) and the model
then fails deep inside construction or the first forward. Each field the Llama family reads is
checked here when present; the error is one line naming the file, the field, the value and what
was expected.
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
    for check in (_architectures, _integers, _numbers, _bools, _head_layout):
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
        if not _is_int(value) or value < 1:
            return _bad(name, value, "an integer >= 1" + (" or null" if name in OPTIONAL_POSITIVE_INTS else ""))
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
