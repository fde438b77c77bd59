"""Every field of every spec kind checked for type and value when it is registered.

A spec with `priority="high"` or `platforms="cpu"` used to pass registration and fail later, inside
`auto` selection, with a TypeError naming no plugin. `check_fields` refuses it at once with one
line naming the plugin, the item and the field: what was expected and what was given.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

ALL_MODES = ("extend", "decode", "target_verify", "draft_extend")
ALL_DTYPES = ("float32", "float16", "bfloat16")
PLATFORMS = ("cpu", "cuda")

Check = Callable[[Any], "str | None"]  # None when the value is valid, else what was expected


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def non_empty_str(value: Any) -> str | None:
    return None if isinstance(value, str) and value.strip() and "\n" not in value else "a non-empty one-line string"


def text(value: Any) -> str | None:
    return None if isinstance(value, str) else "a string"


def flag(value: Any) -> str | None:
    return None if isinstance(value, bool) else "True or False"


def integer(value: Any) -> str | None:
    return None if _is_int(value) else "an integer"


def non_negative_int(value: Any) -> str | None:
    return None if _is_int(value) and value >= 0 else "an integer >= 0"


def optional_positive_int(value: Any) -> str | None:
    return None if value is None or (_is_int(value) and value >= 1) else "None or an integer >= 1"


def function(value: Any) -> str | None:
    return None if callable(value) else "a callable"


def one_of(choices: tuple[str, ...]) -> Check:
    def check(value: Any) -> str | None:
        return None if isinstance(value, str) and value in choices else f"one of {', '.join(choices)}"

    return check


def tuple_of(choices: tuple[str, ...], empty_ok: bool = False) -> Check:
    """A tuple or list of distinct choices (a bare string is refused: 'cpu' is not ('cpu',))."""
    def check(value: Any) -> str | None:
        ok = (isinstance(value, (tuple, list)) and (empty_ok or len(value) > 0)
              and all(isinstance(v, str) and v in choices for v in value) and len(set(value)) == len(value))
        return None if ok else f"a tuple of distinct values from ({', '.join(choices)})" + ("" if empty_ok else ", not empty")

    return check


def distinct_names(what: str) -> Check:
    """A tuple or list of distinct non-empty one-line strings, maybe empty (`what` they name)."""
    def check(value: Any) -> str | None:
        ok = (isinstance(value, (tuple, list)) and all(non_empty_str(v) is None for v in value)
              and len(set(value)) == len(value))
        return None if ok else f"a tuple of distinct non-empty strings ({what})"

    return check


def head_dims(value: Any) -> str | None:
    ok = value is None or (isinstance(value, (tuple, list)) and len(value) > 0
                           and all(_is_int(v) and v >= 1 for v in value))
    return None if ok else "None (any) or a non-empty tuple of integers >= 1"


# NOTE: one rule per field name; every spec kind's fields share these (a `priority` is an int
# wherever it appears). tests/plugin/test_spec_validation.py fails if a spec field has no rule.
FIELD_RULES: dict[str, Check] = {
    "name": non_empty_str,
    "architecture": non_empty_str,
    "op": lambda v: None,  # checked against the op names by the registry (it names the choices)
    "factory": function,
    "fn": function,
    "available": function,
    "description": text,
    "install_hint": text,
    "platforms": tuple_of(PLATFORMS),
    "platform": one_of(PLATFORMS),
    "dtypes": tuple_of(ALL_DTYPES),
    "head_dims": head_dims,
    "modes": tuple_of(ALL_MODES),
    "graph_modes": tuple_of(ALL_MODES, empty_ok=True),
    "piecewise_graph_modes": tuple_of(ALL_MODES, empty_ok=True),
    "kv_cache_dtypes": tuple_of(("fp8_e4m3",), empty_ok=True),
    "custom_mask": flag,
    "sliding_window": flag,
    "logit_softcap": flag,
    "supports_graph": flag,
    "compile_safe": flag,
    "needs_draft_model": flag,
    "supports_lora": flag,
    "supports_sampling": flag,
    "supports_online": flag,
    "supports_tp": flag,
    "supports_compile": flag,
    "checkpoint_formats": distinct_names("quantization_config quant_method values"),
    "seq_len_fill_value": non_negative_int,
    "priority": integer,
    "max_rank": optional_positive_int,
    "max_top_k": optional_positive_int,
    "max_experts": optional_positive_int,
    "quant_methods": distinct_names("quantization method names; () for unquantized only"),
}


def field_problem(item: Any) -> tuple[str, str] | None:
    """(field name, one-line problem) for the first invalid field of a spec dataclass, or None."""
    for f in dataclasses.fields(item):
        rule = FIELD_RULES.get(f.name)
        if rule is None:
            continue
        value = getattr(item, f.name)
        expected = rule(value)
        if expected is not None:
            return f.name, f"field {f.name} = {_show(value)} ({type(value).__name__}): expected {expected}"
    return None


def _show(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."
