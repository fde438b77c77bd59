"""PrefixCache: the scheduler's prefix caching, requests on one side and the radix tree on the other.

The scheduler asks for `admission_order(waiting)` when it may admit requests: the waiting queue
with the longest cached prefixes first (SGLang's "longest prefix match" policy), so that requests
reuse the cache while it holds their prefix instead of admitting them in arrival order and
evicting what the next ones need. Then it calls, per request:
  - `match(req, batch)` when it considers a waiting request: take the longest cached prefix of
    what the request must prefill (locked, so it is not evicted) -- req.num_cached, req.slots and
    req.num_shared start at it -- or defer the request (False) when a request already chosen for
    this batch is about to compute a longer prefix of it; `unmatch(req)` if it is not admitted,
  - `computes_in_batch(req, batch)` for a running request whose next prefill chunk joins the batch:
    requests considered after it that share its prompt are deferred the same way,
  - `admit(req)` once it has a request-pool row: the row's first num_shared columns get the
    cached slots (the rest are written by the extend batch, which has extend_prefix_lens > 0),
  - `cache_prefilled(req, n)` after each successful prefill chunk of n tokens: the new KV joins the
    tree, so requests admitted from the next step on share it,
  - `release(req, keep)` when it finishes or is preempted (keep=True: its KV goes to the tree) or
    is aborted or rolled back after a failed forward (keep=False: its own slots are freed).
It never preempts: `available()` counts free plus evictable slots, and `make_room(n)` evicts
unreferenced leaves (least recently used first) until n slots are free.

Requests on different adapters (req.lora) never share KV: the adapter is the tree's namespace.
With `enabled=False` (--disable-radix-cache) nothing is cached and every request's slots are freed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from backplane.config import PrefixCacheConfig
from backplane.scheduler.radix import RadixTree, join_slots
from backplane.scheduler.request import Req
from backplane.contracts.memory import ReqToTokenPool, TokenToKVPool

# A waiting request whose prompt shares at least this many leading tokens with a request chosen for
# the same prefill batch, more than the tree holds, waits while that request computes them, then
# reads them from the cache instead of computing them a second time. A shorter common head (a chat
# template's first tokens) holds nobody back.
IN_BATCH_SHARE_MIN = 32
# Longer waiting queues are admitted in arrival order: ordering looks every waiting request up in
# the tree (a few microseconds per thousand cached tokens) each time requests may be admitted.
LPM_MAX_WAITING = 256


@dataclass
class PrefixCacheStats:
    """Counted once per admission: tokens to prefill looked up, and how many were cached; and after
    every prefill chunk, the tokens it computed (recomputation after a preemption included)."""

    num_requests: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    prefill_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


def prefill_target(req: Req) -> int:
    """Tokens whose KV a prefill computes: all but the last generated one (it has no KV yet)."""
    return req.num_tokens - (1 if req.output_ids else 0)


class PrefixCache:
    def __init__(self, kv_pool: TokenToKVPool, req_pool: ReqToTokenPool, enabled: bool = True,
                 disabled_reason: str | None = None):
        self.kv_pool, self.req_pool = kv_pool, req_pool
        self.enabled = enabled
        self.disabled_reason = disabled_reason if not enabled else None
        self.tree = RadixTree(kv_pool.free)
        self.counts = PrefixCacheStats()

    @classmethod
    def from_config(cls, runner: Any, config: PrefixCacheConfig) -> PrefixCache:
        """The cache over `runner`'s pools, on or off as `config` (backplane.config) says."""
        return cls(runner.token_to_kv_pool, runner.req_to_token_pool, config.enabled, config.disabled_reason)

    # -- capacity -------------------------------------------------------------------------------

    def available(self) -> int:
        """Slots that can be handed out now: free ones plus those eviction can free."""
        return self.kv_pool.num_free + self.tree.evictable_size

    def make_room(self, num_slots: int) -> None:
        """Evict until `num_slots` slots are free (the caller checked `available()`)."""
        missing = num_slots - self.kv_pool.num_free
        if missing > 0:
            self.tree.evict(missing)
        assert self.kv_pool.num_free >= num_slots, "prefix cache: fewer slots than available() promised"

    def clear(self) -> int:
        """Evict every unreferenced entry (all of them when no request runs); the number freed."""
        return self.tree.evict(self.tree.evictable_size)

    # -- admission ------------------------------------------------------------------------------

    def admission_order(self, waiting: Sequence[Req]) -> list[Req]:
        """The waiting requests, longest cached prefix first; ties (and every request when the
        cache is off or more than LPM_MAX_WAITING wait) in arrival order. Reads the tree only."""
        if not self.enabled or not 1 < len(waiting) <= LPM_MAX_WAITING:
            return list(waiting)
        cached = [self._cached_length(req) for req in waiting]
        order = sorted(range(len(waiting)), key=lambda i: -cached[i])
        return [waiting[i] for i in order]

    def _cached_length(self, req: Req) -> int:
        """What `match` would find for the request, without copying its prompt."""
        stop = prefill_target(req) - 1
        key = req.prompt_ids if stop <= len(req.prompt_ids) else req.ids_between(0, stop)
        return self.tree.match_length(key, req.lora, stop)

    def match(self, req: Req, batch: RadixTree | None = None) -> bool:
        """Start a waiting request at its longest cached prefix; False to defer it (see module doc).

        `batch`: a bookkeeping tree of the keys chosen so far for this prefill batch (None: no check).
        At least one token is left to compute (a prefill must produce the next token's logits).
        """
        if not self.enabled:
            return True
        key = req.ids_between(0, prefill_target(req) - 1)
        found = self.tree.match(key, req.lora)
        if batch is not None:
            computing = batch.match(key, req.lora).length
            if computing >= IN_BATCH_SHARE_MIN and computing > found.length:
                return False
            _note(batch, key, req)
        self.tree.lock(found.node)
        req.prefix_node, req.num_shared = found.node, found.length
        req.num_cached = found.length
        req.slots = [found.slots] if found.length else []
        return True

    def computes_in_batch(self, req: Req, batch: RadixTree | None) -> None:
        """A running request's next prefill chunk joins the batch: note its prompt in `batch`, so
        that a waiting request sharing it waits for the tree instead of computing it twice (None:
        no request considered later)."""
        if self.enabled and batch is not None:
            _note(batch, req.ids_between(0, prefill_target(req) - 1), req)

    def unmatch(self, req: Req) -> None:
        """Undo `match` for a request that was not admitted after all."""
        if req.prefix_node is not None:
            self.tree.unlock(req.prefix_node)
        req.prefix_node, req.num_shared, req.num_cached, req.slots = None, 0, 0, []

    def admit(self, req: Req) -> None:
        """The request has its row: record its cached prefix there and count the lookup."""
        self.counts.num_requests += 1
        self.counts.query_tokens += prefill_target(req)
        self.counts.hit_tokens += req.num_shared
        if req.num_shared:  # cast on the host: one copy straight into the row, no kernel on the device
            row = self.req_pool.req_to_token[req.row, :req.num_shared]
            row.copy_(req.slots[0].to(row.dtype), non_blocking=True)

    # -- after prefill, finish, preemption, abort -------------------------------------------------

    def cache_prefilled(self, req: Req, num_new: int) -> None:
        """After a prefill chunk of `num_new` tokens: move the request's new KV into the tree and
        reference it there.

        Skipped when the tree already holds more of the key than the request shares (another
        request computed the same tokens): the request keeps its own copy until it is released.
        """
        self.counts.prefill_tokens += num_new
        if not self.enabled or req.num_cached <= req.num_shared:
            return
        key, slots = req.ids_between(0, req.num_cached), join_slots(req.slots)
        if self.tree.match(key, req.lora).length != req.num_shared:
            return
        node = self.tree.insert_node(key, slots, req.lora)
        self.tree.lock(node)
        if req.prefix_node is not None:
            self.tree.unlock(req.prefix_node)
        req.prefix_node, req.num_shared, req.slots = node, req.num_cached, [slots]

    def release(self, req: Req, keep: bool) -> None:
        """Give back the request's KV: to the tree (keep) or to the pool (its own slots only).

        With keep, the slots of every token that is also in req.all_ids join the tree (a
        speculative step may have written KV past a stop token; those slots are freed).
        """
        slots = join_slots(req.slots)
        if keep and self.enabled:
            n = min(req.num_cached, req.num_tokens)
            self.tree.insert(req.ids_between(0, n), slots[:n], req.lora)
            self.kv_pool.free(slots[n:])
        else:
            self.kv_pool.free(slots[req.num_shared:])
        if req.prefix_node is not None:
            self.tree.unlock(req.prefix_node)
        req.prefix_node, req.num_shared = None, 0

    # -- reporting ------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Hit and query token counts, the hit rate, the tokens prefill computed, and the tree's size
        (tokens)."""
        c = self.counts
        out = {"enabled": self.enabled, "num_requests": c.num_requests, "query_tokens": c.query_tokens,
               "hit_tokens": c.hit_tokens, "hit_rate": c.hit_rate, "prefill_tokens": c.prefill_tokens,
               "cached_tokens": self.tree.total_size,
               "evictable_tokens": self.tree.evictable_size}
        if self.disabled_reason:
            out["disabled_reason"] = self.disabled_reason
        return out


def _note(batch: RadixTree, key: list[int], req: Req) -> None:
    """Record `key` in the bookkeeping tree of a prefill batch (its slots are placeholders)."""
    batch.insert(key, torch.zeros(len(key), dtype=torch.int64), req.lora)
