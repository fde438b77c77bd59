"""Admission: which requests may run at all, and which of them prefill in this step.

`refusal` turns away at once a request that could never run (an empty prompt, one longer than the
context or the whole KV pool, a token outside the vocabulary), so it never waits for room that will
not come. `admit_prefill` chooses one step's prefill batch with a `PrefillAdder`: running requests
still mid-prompt first, then waiting ones (longest cached prefix first with a prefix cache), each
prefilling as much of its prompt as the step's limits leave; the new ones get a request row. `ready_for_decode` picks the running requests a decode step
may run.
"""

from __future__ import annotations

from typing import Sequence

from backplane.contracts.protocols import SchedulerParticipant
from backplane.scheduler.overlap import LaunchedStep
from backplane.scheduler.prefix_cache import PrefixCache
from backplane.scheduler.queues import RequestQueues
from backplane.scheduler.radix import RadixTree
from backplane.scheduler.request import Req


def refusal(req: Req, *, context_len: int, num_kv_slots: int, spare_slots: int, vocab_size: int | None) -> str | None:
    """Why `req` can never run (empty, too long, outside the vocabulary), or None.

    spare_slots: KV slots a decode step holds beyond the request's last position (the draft tokens
    of a speculative step); vocab_size: None or 0 skips the vocabulary check.
    """
    n, m = len(req.prompt_ids), req.params.max_new_tokens
    if n == 0:
        return f"request {req.rid}: empty prompt; expected at least one token"
    if n + m > context_len:
        return (f"request {req.rid}: prompt of {n} tokens + max_new_tokens {m} exceeds the context "
                f"length {context_len}; shorten the prompt or lower max_new_tokens")
    if n + m + spare_slots > num_kv_slots:
        return (f"request {req.rid}: prompt of {n} tokens + max_new_tokens {m} needs {n + m + spare_slots} KV slots "
                f"but the pool holds {num_kv_slots}; raise --max-total-tokens")
    ids = req.prompt_ids
    if vocab_size and not (min(ids) >= 0 and max(ids) < vocab_size):  # min/max first: they run at C speed
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        return f"request {req.rid}: token id {bad} is outside the vocabulary; expected ids in [0, {vocab_size})"
    return None


def admit_prefill(queues: RequestQueues, participants: Sequence[SchedulerParticipant], *, token_budget: int,
                  max_running: int, decode_slots_per_request: int,
                  prefilling: list[Req] | None = None) -> tuple[list[Req], list[int]] | None:
    """This step's prefill batch (the requests, and the tokens each prefills), its new requests
    admitted and the KV room for it made; None when nothing can prefill (limits: `PrefillAdder`).

    prefilling: `mid_prompt(queues.running)` when the caller has it already (else computed here).
    """
    mid = prefilling if prefilling is not None else mid_prompt(queues.running)
    if not mid and not queues.waiting:
        return None  # every decode step: nothing to consider
    cache = queues.prefix_cache
    adder = PrefillAdder(cache, queues.running, participants, token_budget=token_budget, max_running=max_running,
                         decode_slots_per_request=decode_slots_per_request, isolated=queues.isolated,
                         shares_prompts=len(mid) + len(queues.waiting) > 1)
    waiting = cache.admission_order(queues.waiting) if adder.may_admit() else list(queues.waiting)
    for req in mid + waiting:
        if not adder.add(req):
            break
    if not adder.reqs:
        return None
    cache.make_room(sum(adder.chunks))
    queues.admit(adder.new)
    return adder.reqs, adder.chunks

class PrefillAdder:
    """One step's prefill batch, chosen request by request (`add`); `reqs` and `chunks` (the
    tokens each prefills) once done.

    Limits: `token_budget` tokens in all (--chunked-prefill-size); the KV slots available in
    `cache` once every decoding running request has `decode_slots_per_request` reserved for its next
    step; at most `max_running` requests holding a row. A new request also needs every participant's
    `can_admit` next to the running requests and the new ones already chosen. The first request that
    does not fit ends the batch, so later arrivals never overtake it. A request in `isolated` (it runs
    alone since a failed forward) only starts an empty batch, and nothing joins it. `shares_prompts`
    False (a lone candidate: no later request can share its prompt) skips the bookkeeping of the
    prompts the batch computes.
    """

    def __init__(self, cache: PrefixCache, running: list[Req], participants: Sequence[SchedulerParticipant], *,
                 token_budget: int, max_running: int, decode_slots_per_request: int, isolated: set[int],
                 shares_prompts: bool = True):
        self.cache = cache
        self.running = running
        self.participants = participants
        self.budget = token_budget
        self.max_running = max_running
        self.reserved = decode_slots_per_request * sum(1 for r in running if not r.needs_prefill)
        self.isolated = isolated
        self.in_batch = RadixTree() if shares_prompts else None  # the prompts this batch computes, for prefix sharing
        self.reqs: list[Req] = []
        self.chunks: list[int] = []
        self.new: list[Req] = []  # the chosen requests that have no row yet

    def may_admit(self) -> bool:
        """Whether a request row is free for a waiting request."""
        return len(self.running) + len(self.new) < self.max_running

    def add(self, req: Req) -> bool:
        """Put `req` (running mid-prompt, or waiting) in the batch if it fits; False when no later
        request may be tried."""
        is_new = req.row is None
        if self.budget == 0 or (is_new and not self.may_admit()) or (self.reqs and req.rid in self.isolated):
            return False
        if is_new and not self.cache.match(req, self.in_batch):
            return True  # a request in this batch computes its prefix; it reads it from the cache next
        if not is_new:
            self.cache.computes_in_batch(req, self.in_batch)
        n = min(req.num_tokens - req.num_cached - (1 if req.output_ids else 0), self.budget)
        # NOTE: available() is read after match(), which locks the request's cached prefix.
        if n > self.cache.available() - self.reserved - sum(self.chunks) or (is_new and not self._admissible(req)):
            if is_new:
                self.cache.unmatch(req)
            return False
        self.reqs.append(req)
        self.chunks.append(n)
        self.budget -= n
        if is_new:
            self.new.append(req)
        return req.rid not in self.isolated

    def _admissible(self, req: Req) -> bool:
        batch_mates = self.running + self.new
        return all(p.can_admit(req, batch_mates) for p in self.participants)


def mid_prompt(running: list[Req]) -> list[Req]:
    """The running requests still prefilling their prompt (or, recomputed, their output so far)."""
    return [r for r in running if r.needs_prefill]


def ready_for_decode(running: list[Req], in_flight: LaunchedStep | None,
                     prefilling: list[Req] | None = None) -> list[Req]:
    """Running requests that can decode. Under overlap (`in_flight`: the step whose tokens are not
    read yet), one whose token in flight is its last (max_new_tokens reached) is left out: it
    finishes when that step is read, and a step for it would only be thrown away.

    prefilling: `mid_prompt(running)` when the caller has it already (else computed here).
    """
    if prefilling is None:
        ready = [r for r in running if not r.needs_prefill]
    elif prefilling:
        ids = {id(r) for r in prefilling}
        ready = [r for r in running if id(r) not in ids]
    else:  # NOTE: the usual case: every running request decodes, no test per request
        ready = list(running)
    if in_flight is None:
        return ready
    last = {id(r) for r in in_flight.reqs if r.next_token_is_last}
    return [r for r in ready if id(r) not in last] if last else ready
