"""SpecRequest: what a speculative algorithm sees of one engine request.

The scheduler's request object is private to the core. A draft worker's hooks (`draft`,
`after_prefill`, `after_verify`) receive a `SpecRequest` over each request instead: its tokens so
far, how many of them have their KV cached, its row in the target's request pool, and `state`, a
slot the algorithm owns (EAGLE keeps the target's features there). The core keeps the state on its
request (the field 0.1 algorithms wrote themselves, so old and new code see one value), indexes it
in a `RequestStore`, and drops it when the request finishes or is preempted (its KV is gone, so a
state about it would be stale); a preempted request starts again from a prefill.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

S = TypeVar("S")


@dataclass
class RequestAcceptance:
    """One request's speculative steps: `steps` verify steps, `accepted_drafts` drafts the target
    agreed with, `tokens` tokens gained (accepted drafts plus one bonus token per step)."""

    steps: int = 0
    accepted_drafts: int = 0
    tokens: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens gained per step (1 when no draft was ever accepted), 0.0 before any step."""
        return self.tokens / self.steps if self.steps else 0.0

    def to_dict(self) -> dict[str, float]:
        """For JSON output (`generate --json`): the three counts and mean_acceptance_length."""
        return {"steps": self.steps, "accepted_drafts": self.accepted_drafts, "tokens": self.tokens,
                "mean_acceptance_length": self.mean_acceptance_length}


class _Entry:
    __slots__ = ("ref", "acceptance")

    def __init__(self, ref: weakref.ref):
        self.ref, self.acceptance = ref, RequestAcceptance()


class RequestStore:
    """The requests a speculative worker has seen, by request object: their acceptance counts
    (kept as long as the request object lives: the engine reads them when the request ends), and
    which of them hold a state (`prune` drops it once the request finished or was released)."""

    def __init__(self):
        self._entries: dict[int, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def num_states(self) -> int:
        """How many requests have a state stored (what `prune` keeps bounded)."""
        return sum(1 for e in self._entries.values() if getattr(e.ref(), "spec_state", None) is not None)

    def entry(self, req: Any) -> _Entry:
        key = id(req)
        found = self._entries.get(key)
        if found is None or found.ref() is not req:
            found = _Entry(weakref.ref(req, lambda _, key=key: self._entries.pop(key, None)))
            self._entries[key] = found
        return found

    def peek(self, req: Any) -> _Entry | None:
        found = self._entries.get(id(req))
        return found if found is not None and found.ref() is req else None

    def prune(self) -> None:
        """Drop the state of every request that finished or gave its KV back (no request row)."""
        for found in list(self._entries.values()):
            req = found.ref()
            if req is not None and (req.finished or req.row is None):
                req.spec_state = None


class SpecRequest(Generic[S]):
    """A draft worker's view of one request (read-only, but for `state`).

    token_ids: prompt then output ids so far (a new list); num_tokens: their count; last_token: the
    root of the next draft (the last token the target chose, not yet in the KV cache);
    tokens(start, stop): token_ids[start:stop], copying only that slice; num_cached: how many
    tokens have their KV in the target's pool (positions 0 .. num_cached - 1); row: the request's
    row in the target's `req_to_token_pool` (`req_to_token[row, :num_cached]` are its KV slots);
    rid: the request number; state: the algorithm's own value for this request (None until set).
    """

    __slots__ = ("_req", "_store")

    def __init__(self, req: Any, store: RequestStore):
        self._req, self._store = req, store

    @property
    def rid(self) -> int:
        return int(self._req.rid)

    @property
    def token_ids(self) -> list[int]:
        return self._req.prompt_ids + self._req.output_ids

    @property
    def num_tokens(self) -> int:
        return self._req.num_tokens

    @property
    def last_token(self) -> int:
        return self._req.token_at(self._req.num_tokens - 1)

    def tokens(self, start: int, stop: int | None = None) -> list[int]:
        """token_ids[start:stop] for 0 <= start <= stop <= num_tokens (stop None: num_tokens)."""
        stop = self._req.num_tokens if stop is None else stop
        if not 0 <= start <= stop <= self._req.num_tokens:
            raise ValueError(f"SpecRequest.tokens: expected 0 <= start <= stop <= {self._req.num_tokens}, "
                             f"got start {start}, stop {stop}")
        return self._req.ids_between(start, stop)

    @property
    def num_cached(self) -> int:
        return int(self._req.num_cached)

    @property
    def row(self) -> int:
        return int(self._req.row)

    def cached_slots(self) -> torch.Tensor:
        """The KV slots of positions 0 .. num_cached - 1, in order (a host int64 copy)."""
        slots = self._req.slots
        flat = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64)
        return flat[: self.num_cached].clone()

    @property
    def state(self) -> S | None:
        return getattr(self._req, "spec_state", None)

    @state.setter
    def state(self, value: S | None) -> None:
        self._store.entry(self._req)  # indexed, so that `prune` drops it with the request
        self._req.spec_state = value

    # -- deprecated (the request object of 0.1, which algorithms used to receive) ---------------

    @property
    def all_ids(self) -> list[int]:
        _deprecated("all_ids", "token_ids")
        return self.token_ids

    @property
    def spec_state(self) -> S | None:
        _deprecated("spec_state", "state")
        return self.state

    @spec_state.setter
    def spec_state(self, value: S | None) -> None:
        _deprecated("spec_state", "state")
        self.state = value

    def __repr__(self) -> str:
        return f"SpecRequest(rid={self.rid}, num_tokens={self.num_tokens}, num_cached={self.num_cached})"


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"request.{old} is deprecated: a speculative algorithm receives a SpecRequest; "
                  f"use SpecRequest.{new} (backplane.speculative)", DeprecationWarning, stacklevel=3)


def engine_requests(reqs: list) -> list:
    """The engine's requests behind `reqs` (SpecRequests are unwrapped, others kept): for the core's
    collaborators, which read the request object itself."""
    return [r._req if isinstance(r, SpecRequest) else r for r in reqs]
