"""What `generate` accepts as prompts, one request at a time.

`prompts` and `input_ids` may be a single request or a list of them. A request is a string
(text, `prompts` only), a list or tuple of integer token ids, or a 1-D integer numpy array or
torch tensor (converted to a list). A malformed request gets an error of its own, which aborts it
alone; only a malformed whole (input_ids given as one string, a 3-D array) fails the call.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral
from typing import Any


@dataclass
class PromptInput:
    """One request's prompt: text to tokenize, token ids, or why it is unusable (`error`)."""

    text: str | None = None
    ids: list[int] | None = None
    error: str | None = None


def split_prompts(prompts: Any, input_ids: Any) -> list[PromptInput]:
    """One PromptInput per request; ValueError (one line) when neither or both are given, or the
    whole is not a request or a list of requests."""
    if (prompts is None) == (input_ids is None):
        raise ValueError("generate: pass exactly one of prompts or input_ids")
    name, value, allow_text = ("prompts", prompts, True) if input_ids is None else ("input_ids", input_ids, False)
    items, one = _requests_of(value, name, allow_text)
    return [_prompt_input(item, name if one else f"{name}[{i}]", allow_text) for i, item in enumerate(items)]


def _requests_of(value: Any, name: str, allow_text: bool) -> tuple[list[Any], bool]:
    """(the requests, whether `value` was a single one)."""
    if isinstance(value, str):
        if allow_text:
            return [value], True
        raise ValueError(f"generate: input_ids: expected token ids (a list of integers or a list of such lists), "
                         f"got the string {_short(value)}; pass text as prompts")
    if _is_array(value):
        if value.ndim == 1:
            return [value], True
        if value.ndim == 2:
            return list(value), False
        raise ValueError(f"generate: {name}: expected a 1-D array (one request) or a 2-D array (one row per "
                         f"request), got an array of shape {tuple(value.shape)}")
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"generate: {name}: expected {_EXPECTED[allow_text]} or a list of them, "
                         f"got {type(value).__name__}")
    if value and _is_scalar(value[0]):
        return [value], True  # one request's ids: [5, 6, 7]
    return list(value), False


def _prompt_input(item: Any, name: str, allow_text: bool) -> PromptInput:
    if isinstance(item, str):
        if allow_text:
            return PromptInput(text=item)
        return PromptInput(error=f"{name}: expected token ids, got the string {_short(item)}; pass text as prompts")
    if _is_array(item):
        if item.ndim != 1:
            return PromptInput(error=f"{name}: expected a 1-D array of token ids, got shape {tuple(item.shape)}")
        if not _integer_dtype(item):
            return PromptInput(error=f"{name}: expected integer token ids, got an array of dtype {item.dtype}")
        return PromptInput(ids=[int(t) for t in item.tolist()])
    if not isinstance(item, (list, tuple)):
        return PromptInput(error=f"{name}: expected {_EXPECTED[allow_text]}, got {type(item).__name__} {_short(item)}")
    if set(map(type, item)) <= {int}:  # the common case, checked at C speed (bool is not int here)
        return PromptInput(ids=list(item))
    for i, token in enumerate(item):
        if not _is_int(token):
            return PromptInput(error=f"{name}: expected integer token ids, got {_short(token)} "
                                     f"({type(token).__name__}) at position {i}")
    return PromptInput(ids=[int(t) for t in item])


_EXPECTED = {True: "a string or a list of token ids", False: "a list of token ids"}


def _is_int(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_scalar(value: Any) -> bool:
    """A token id (or a bad one), not a request: numpy integers have `ndim` 0."""
    return not isinstance(value, (list, tuple, str, dict)) and not (_is_array(value) and value.ndim > 0)


def _is_array(value: Any) -> bool:
    """A numpy array or a torch tensor (duck-typed: numpy need not be installed)."""
    return all(hasattr(value, a) for a in ("ndim", "shape", "dtype", "tolist"))


def _integer_dtype(array: Any) -> bool:
    dtype = array.dtype
    if hasattr(dtype, "is_floating_point"):  # torch
        return not (dtype.is_floating_point or dtype.is_complex or str(dtype) == "torch.bool")
    return getattr(dtype, "kind", "") in ("i", "u")  # numpy: signed or unsigned integers


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
