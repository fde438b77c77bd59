"""Resolving custom ops once, when the model is built, into a plain table of callables.

For each op the highest-priority usable implementation registered for the platform wins, unless
`--custom-ops op=name` names one. The native implementation is always available under "native".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from typing import Callable

from backplane.ops.names import OP_NAMES
from backplane.ops.native import NATIVE_OPS
from backplane.plugin.registry import CustomOpImpl

NATIVE = "native"
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CustomOps:
    """One plain callable per op (signatures of `backplane.ops.native`), plus what was chosen.

    chosen: op name -> implementation name, for logging.
    """

    rms_norm: Callable
    fused_add_rms_norm: Callable
    silu_and_mul: Callable
    gelu_and_mul: Callable
    gelu: Callable
    quick_gelu: Callable
    rotary_embedding: Callable
    chosen: dict[str, str] = field(default_factory=dict)

    @classmethod
    def native(cls) -> CustomOps:
        """The all-native table (used inside torch.compile and when nothing else is registered)."""
        return cls(**NATIVE_OPS, chosen={op: NATIVE for op in OP_NAMES})


assert tuple(f.name for f in fields(CustomOps))[:-1] == OP_NAMES, "CustomOps fields must follow OP_NAMES"


def _pick(op: str, candidates: list[CustomOpImpl], platform: str, override: str | None) -> tuple[str, Callable]:
    """The (name, fn) used for `op` among its implementations registered on `platform`."""
    if override is not None:
        return _pick_override(op, candidates, platform, override)
    usable = [impl for impl in candidates if impl.available() is None]
    best = max(usable, key=lambda impl: (impl.priority, impl.name == NATIVE, impl.name), default=None)
    name, fn = (best.name, best.fn) if best is not None else (NATIVE, NATIVE_OPS[op])
    passed = [impl for impl in candidates if impl not in usable and (best is None or impl.priority > best.priority)]
    if passed:  # a preferred implementation cannot run here: say so instead of falling back silently
        logger.warning("custom op %s on %s: using %s because %s", op, platform, name,
                       "; ".join(f"{impl.name} (priority {impl.priority}) cannot run: {impl.available()}"
                                 for impl in passed))
    return name, fn


def _pick_override(op: str, candidates: list[CustomOpImpl], platform: str, name: str) -> tuple[str, Callable]:
    matches = [impl for impl in candidates if impl.name == name]
    if not matches:
        if name == NATIVE:
            return NATIVE, NATIVE_OPS[op]
        registered = sorted({NATIVE, *(impl.name for impl in candidates)})
        raise ValueError(
            f"custom op override '{op}={name}': unknown implementation {name!r} for op {op!r} on "
            f"{platform}; registered: {', '.join(registered)}"
        )
    reason = matches[0].available()
    if reason is not None:
        raise ValueError(f"custom op override '{op}={name}': implementation {name!r} cannot run here: {reason}")
    return name, matches[0].fn


def resolve_custom_ops(impls: list[CustomOpImpl], platform: str, overrides: dict[str, str]) -> CustomOps:
    """Choose one implementation per op for `platform`.

    impls: every registered implementation (any platform); overrides: op name -> implementation
    name from `--custom-ops`. Raises ValueError for an unknown op or implementation in overrides,
    or an overridden implementation whose `available()` gives a reason.
    """
    for op, name in overrides.items():
        if op not in OP_NAMES:
            raise ValueError(
                f"custom op override '{op}={name}': unknown op {op!r}; expected one of: {', '.join(OP_NAMES)}"
            )
    table, chosen = {}, {}
    for op in OP_NAMES:
        candidates = [impl for impl in impls if impl.op == op and impl.platform == platform]
        chosen[op], table[op] = _pick(op, candidates, platform, overrides.get(op))
    return CustomOps(**table, chosen=chosen)
