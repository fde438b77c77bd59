"""Resolving custom ops once, when the model is built, into a plain table of callables.

For each op the highest-priority usable implementation registered for the platform wins, unless
`--custom-ops op=name` names one. The native implementation is always available under "native".
A plugin's implementation is first run once on a small input next to the native op (backplane.plugin.op_probe):
one that raises or returns another shape, dtype or value is skipped under auto, with the reason
logged, and refused in one line when named explicitly (backplane.plugin.op_probe).
Inside torch.compile the table's `for_compile()` is used: the ops whose implementation declared
`compile_safe` stay, the others are replaced by their native implementation.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields, replace
from typing import Callable

from backplane.ops.names import OP_NAMES
from backplane.ops.native import NATIVE_OPS
from backplane.plugin.op_probe import probe_problem
from backplane.plugin.registry import CustomOpImpl
from backplane.plugin.selection import available_reason

NATIVE = "native"
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CustomOps:
    """One plain callable per op (signatures of `backplane.ops.native`), plus what was chosen.

    chosen: op name -> implementation name, for logging.
    compile_safe: the ops whose chosen implementation may be traced by torch.compile as it is
      (native ones always; a plugin's when its CustomOpImpl declares compile_safe).
    """

    rms_norm: Callable
    fused_add_rms_norm: Callable
    silu_and_mul: Callable
    gelu_and_mul: Callable
    gelu: Callable
    quick_gelu: Callable
    rotary_embedding: Callable
    rotary_kv_write: Callable
    greedy_sample: Callable
    moe_route: Callable
    chosen: dict[str, str] = field(default_factory=dict)
    compile_safe: frozenset[str] = frozenset(OP_NAMES)

    @classmethod
    def native(cls) -> CustomOps:
        """The all-native table (used when nothing else is registered)."""
        return cls(**NATIVE_OPS, chosen={op: NATIVE for op in OP_NAMES})

    def for_compile(self) -> CustomOps:
        """The table to use inside torch.compile: ops not declared compile-safe become native."""
        swapped = {op: NATIVE_OPS[op] for op in OP_NAMES if op not in self.compile_safe}
        if not swapped:
            return self
        chosen = {**self.chosen, **{op: NATIVE for op in swapped}}
        return replace(self, **swapped, chosen=chosen, compile_safe=frozenset(OP_NAMES))


assert tuple(f.name for f in fields(CustomOps))[:-2] == OP_NAMES, "CustomOps fields must follow OP_NAMES"


def _native_impl(op: str, platform: str) -> CustomOpImpl:
    return CustomOpImpl(op=op, platform=platform, fn=NATIVE_OPS[op], name=NATIVE, compile_safe=True)


def _pick(op: str, candidates: list[CustomOpImpl], platform: str, override: str | None, owner, check) -> CustomOpImpl:
    """The implementation used for `op` among those registered on `platform`: the best one whose
    `available()` gives no reason and whose probe passes, else the native one."""
    if override is not None:
        return _pick_override(op, candidates, platform, override, owner, check)
    reasons = {id(impl): why for impl in candidates if (why := available_reason(impl)) is not None}
    ranked = sorted((impl for impl in candidates if id(impl) not in reasons),
                    key=lambda impl: (impl.priority, impl.name == NATIVE, impl.name), reverse=True)
    chosen, failed = None, []
    for impl in ranked:
        problem = check(impl)
        if problem is None:
            chosen = impl
            break
        reasons[id(impl)] = f"{problem} ({owner(impl)})"
        failed.append(impl)
    chosen = chosen or _native_impl(op, platform)
    passed = [impl for impl in candidates if id(impl) in reasons and (impl.priority > chosen.priority or impl in failed)]
    if passed:  # a preferred implementation cannot run here: say so instead of falling back silently
        logger.warning("custom op %s on %s: using %s because %s", op, platform, chosen.name,
                       "; ".join(f"{impl.name} (priority {impl.priority}) cannot run: {reasons[id(impl)]}"
                                 for impl in passed))
    return chosen


def _pick_override(op: str, candidates: list[CustomOpImpl], platform: str, name: str, owner, check) -> CustomOpImpl:
    matches = [impl for impl in candidates if impl.name == name]
    if not matches:
        if name == NATIVE:
            return _native_impl(op, platform)
        registered = sorted({NATIVE, *(impl.name for impl in candidates)})
        raise ValueError(
            f"custom op override '{op}={name}': unknown implementation {name!r} for op {op!r} on "
            f"{platform}; registered: {', '.join(registered)}"
        )
    reason = available_reason(matches[0]) or check(matches[0])
    if reason is not None:
        raise ValueError(f"custom op override '{op}={name}': implementation {name!r} ({owner(matches[0])}) "
                         f"cannot run here: {reason}")
    return matches[0]


def resolve_custom_ops(impls: list[CustomOpImpl], platform: str, overrides: dict[str, str],
                       registry=None, probe: bool = False) -> CustomOps:
    """Choose one implementation per op for `platform`.

    impls: every registered implementation (any platform); overrides: op name -> implementation
    name from `--custom-ops`; registry: when given, messages name the plugin of an implementation;
    probe: run each plugin implementation considered once against the native op first (the model
    runner does; unit tests of the choice with stand-in functions do not).
    Raises ValueError for an unknown op or implementation in overrides, or an overridden
    implementation whose `available()` gives a reason or that fails its probe.
    """
    for op, name in overrides.items():
        if op not in OP_NAMES:
            raise ValueError(
                f"custom op override '{op}={name}': unknown op {op!r}; expected one of: {', '.join(OP_NAMES)}"
            )
    picked = {}
    for op in OP_NAMES:
        candidates = [impl for impl in impls if impl.op == op and impl.platform == platform]
        check = (lambda impl, op=op: probe_problem(op, impl, platform)) if probe else (lambda impl: None)
        picked[op] = _pick(op, candidates, platform, overrides.get(op), _owner(registry), check)
    return CustomOps(**{op: impl.fn for op, impl in picked.items()},
                     chosen={op: impl.name for op, impl in picked.items()},
                     compile_safe=frozenset(op for op, impl in picked.items()
                                            if impl.compile_safe or impl.fn is NATIVE_OPS[op]))


def _owner(registry):
    """impl -> 'plugin NAME' (from the registry's provenance) for messages; 'plugin unknown' without one."""
    def owner(impl: CustomOpImpl) -> str:
        key = f"{impl.op}/{impl.platform}/{impl.name}"
        if registry is None or key not in registry.items["custom_op"]:
            return "plugin unknown"
        return f"plugin {registry.provenance('custom_op', key).plugin!r}"

    return owner
