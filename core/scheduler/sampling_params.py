"""SamplingParams: how one request's tokens are chosen and when it stops."""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Any

MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes an unsigned 64-bit seed
MAX_STOP_STRINGS = 32  # OpenAI takes 4; a bound keeps one request from slowing its neighbours
MAX_STOP_LENGTH = 256  # characters per stop string


@dataclass
class SamplingParams:
    """Per-request sampling settings, validated on construction and again when a request is
    submitted (a field changed after construction is caught there, for that request alone).

    temperature 0 means greedy. top_k 0 (or -1) and top_p 1 disable those filters; min_p 0 too.
    seed: the same seed gives the same tokens for the same prompt, whatever else is in the batch.
    stop: strings that end the request (the text is cut before them); stop_token_ids: token ids
    that end it (kept in token_ids). ignore_eos keeps generating past the end-of-sequence token.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field: "SamplingParams.top_p: expected ..., got ..."."""
        problem = self.problem()
        if problem:
            raise ValueError(problem)

    def problem(self) -> str | None:
        """The first bad field as one line (as `validate` raises it), or None when all are valid."""
        for name, expected, ok in _CHECKS:
            value = getattr(self, name)
            if not ok(value):
                return f"SamplingParams.{name}: expected {expected}, got {_shown(value)}"
        return None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _shown(value: Any) -> str:
    """A short repr: a long list or string is cut (its length said), so the error stays one line."""
    shown = reprlib.repr(value)
    return f"{shown} ({len(value)} items)" if isinstance(value, (list, tuple)) and len(value) > 6 else shown


def _int(value: Any) -> bool:
    # NOTE: the exact-type test first: isinstance against the numbers ABCs costs about 0.3 us a call,
    # twice per field for every request submitted.
    return type(value) is int or (isinstance(value, Integral) and not isinstance(value, bool))


def _real(value: Any) -> bool:
    """A finite number (not a bool, not NaN or infinity)."""
    if type(value) is float or type(value) is int:  # the usual cases, without the ABC checks
        return math.isfinite(value)
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


def _strings(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(s, str) and s for s in value)


def _bounded_stops(value: Any) -> bool:
    return len(value) <= MAX_STOP_STRINGS and all(len(s) <= MAX_STOP_LENGTH for s in value)


def _token_ids(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(_int(t) and t >= 0 for t in value)


# (field, what is expected, check) in the order they are reported.
_CHECKS = (
    ("max_new_tokens", "an integer >= 1", lambda v: _int(v) and v >= 1),
    ("temperature", ">= 0 (0 is greedy)", lambda v: _real(v) and v >= 0),
    ("top_k", "an integer >= 1, or 0/-1 for no limit", lambda v: _int(v) and v >= -1),
    ("top_p", "in (0, 1]", lambda v: _real(v) and 0 < v <= 1),
    ("min_p", "in [0, 1]", lambda v: _real(v) and 0 <= v <= 1),
    ("seed", f"None or an integer in [0, {MAX_SEED}]", lambda v: v is None or (_int(v) and 0 <= v <= MAX_SEED)),
    ("stop", "non-empty strings", _strings),
    ("stop", f"at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_LENGTH} characters each", _bounded_stops),
    ("stop_token_ids", "token ids >= 0", _token_ids),
    ("ignore_eos", "True or False", lambda v: isinstance(v, bool)),
)
