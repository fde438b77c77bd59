"""Where each request is, and every way it leaves the running set.

A request waits (`waiting`, in arrival order) until admission gives it a request row; it then runs
(`running`) and holds KV slots until it finishes, is preempted (back to the head of the queue, to be
recomputed later with its output so far), or is aborted. `RequestQueues.release` is the one place a
request's row and KV go back.

Recovery after a failed forward (`roll_back`): a lone request in the failed batch is aborted; when
several ran together, each is preempted and from then on runs alone (`isolated`), so the next
failure names the culprit.
"""

from __future__ import annotations

from collections import deque
from operator import indexOf

from backplane.contracts.memory import ReqToTokenPool
from backplane.scheduler.overlap import FutureTokens
from backplane.scheduler.prefix_cache import PrefixCache
from backplane.scheduler.request import Req


class RequestQueues:
    """The waiting queue and the running set over one request pool and its prefix cache.

    isolated: ids of the requests that run alone since a failed forward. future: the overlap
    loop's future-token ring, which forgets a request released (None without overlap).
    """

    def __init__(self, req_pool: ReqToTokenPool, prefix_cache: PrefixCache, future: FutureTokens | None = None):
        self.req_pool = req_pool
        self.prefix_cache = prefix_cache
        self.future = future
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.isolated: set[int] = set()

    def admit(self, reqs: list[Req]) -> None:
        """Give each waiting request of `reqs` a row and its cached prefix there; it runs from now."""
        for req in reqs:
            _remove(self.waiting, req)
            req.row = self.req_pool.alloc()
            self.prefix_cache.admit(req)
            self.running.append(req)

    def finish(self, req: Req) -> None:
        """A running request stopped: its valid KV goes to the prefix cache."""
        self.release(req, keep=True)
        _remove(self.running, req)
        self.isolated.discard(req.rid)

    def preempt(self, req: Req, keep: bool = False) -> None:
        """Free a running request's row and KV and queue it first, to be recomputed."""
        self.release(req, keep)
        _remove(self.running, req)
        self.waiting.appendleft(req)

    def release(self, req: Req, keep: bool = False) -> None:
        """Free the request's KV and row; keep=True hands valid KV to the prefix cache (not after a
        failed forward, whose slots may be half written)."""
        self.prefix_cache.release(req, keep)
        req.slots, req.num_cached = [], 0
        if req.row is not None:
            self.req_pool.free(req.row)
            req.row = None
        if self.future is not None:
            self.future.forget(req)

    def abort(self, req: Req, message: str) -> None:
        """Abort one queued or running request and return its KV slots and row at once."""
        if not _remove(self.running, req):
            _remove(self.waiting, req)
        self.release(req)
        req.abort(message)

    def abort_all(self, message: str) -> list[Req]:
        """Abort every queued and running request (after an unrecoverable forward error)."""
        reqs = list(self.running) + list(self.waiting)
        for req in reqs:
            self.release(req)
            req.abort(message)
        self.running.clear()
        self.waiting.clear()
        return reqs

    def roll_back(self, batch: list[Req], message: str) -> list[Req]:
        """After the forward of `batch` failed: the requests aborted (see the module docstring).

        Requests of `batch` no longer running are skipped; with none left (a failure while
        scheduling) every request is aborted.
        """
        batch = [r for r in batch if any(r is s for s in self.running)]
        if not batch:
            return self.abort_all(message)
        if len(batch) == 1:
            req = batch[0]
            self.release(req)
            _remove(self.running, req)
            self.isolated.discard(req.rid)
            req.abort(message)
            return [req]
        for req in reversed(batch):
            self.preempt(req)
            self.isolated.add(req.rid)
        return []


def _remove(queue: list[Req] | deque[Req], req: Req) -> bool:
    """Remove `req` itself (by identity) from `queue`; whether it was there.

    NOTE: not `queue.remove(req)`: Req is a dataclass, whose `==` builds and compares a tuple of all
    its fields with every request before it, about 1 us each: a request finishing deep in a running
    set of hundreds would pay a few hundred of those. Identity is what a queue holds a request by.
    """
    if queue and queue[0] is req:  # the usual case for the waiting queue
        if isinstance(queue, deque):
            queue.popleft()
        else:
            del queue[0]
        return True
    try:
        i = indexOf(map(id, queue), id(req))
    except ValueError:
        return False
    del queue[i]
    return True
