"""Options of the "eagle" algorithm: `--eagle.<option>` on the command line, `BACKPLANE_EAGLE__<OPTION>`
in the environment, `Engine(plugin_options={"eagle": {...}})` in Python.

The 0.1 flags `--speculative-draft-model`, `--speculative-num-steps`, `--speculative-eagle-topk` and
`--speculative-token-map` still work until 0.3: a value given there (not the default) is used with a
DeprecationWarning naming the new flag, and the two given with different values are refused.
"""

from __future__ import annotations

import warnings
from typing import Any

from pydantic import BaseModel, Field

GROUP = "eagle"
# option -> the deprecated EngineArgs field that set it in 0.1
LEGACY = {"draft_model": "speculative_draft_model", "num_steps": "speculative_num_steps",
          "topk": "speculative_eagle_topk", "token_map": "speculative_token_map"}


class EagleOptions(BaseModel):
    """The draft head and the shape of the tree it drafts (--speculative-num-draft-tokens, shared by
    every algorithm, says how many of its nodes are verified)."""

    draft_model: str | None = Field(None, description="EAGLE draft head directory (config.json and safetensors)")
    num_steps: int = Field(3, ge=1, description="draft steps: the depth of the drafted tree")
    topk: int = Field(1, ge=1, description="branching factor of the draft tree (1: a chain)")
    token_map: str | None = Field(
        None, description="a .pt file of token ids the draft chooses among (a smaller lm_head)")


def flag(option: str) -> str:
    return f"--{GROUP}.{option.replace('_', '-')}"


def legacy_flag(option: str) -> str:
    return "--" + LEGACY[option].replace("_", "-")


def resolve_options(options: EagleOptions | None, args: Any) -> tuple[EagleOptions, dict[str, str]]:
    """The options in effect and, for each, the flag that set it (for error messages).

    A deprecated flag given a value other than its default wins over the group's default, with a
    DeprecationWarning; given together with the new flag at another value, it is a ValueError."""
    options = options if options is not None else EagleOptions()
    values, flags = options.model_dump(), {name: flag(name) for name in LEGACY}
    for name, old_field in LEGACY.items():
        old = getattr(args, old_field, None)
        if old is None or old == type(args).model_fields[old_field].default:
            continue
        if name in options.model_fields_set and values[name] != old:
            raise ValueError(f"{legacy_flag(name)} {old!r} and {flag(name)} {values[name]!r}: two values for one "
                             f"option; pass only {flag(name)} ({legacy_flag(name)} is deprecated)")
        warnings.warn(f"{legacy_flag(name)} is deprecated (until 0.3): use {flag(name)}", DeprecationWarning,
                      stacklevel=2)
        values[name], flags[name] = old, legacy_flag(name)
    return EagleOptions(**values), flags
