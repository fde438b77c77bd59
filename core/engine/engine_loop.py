"""EngineLoop: the scheduler loop that AsyncEngine's thread and `backplane serve`'s engine process run.

It owns an Engine. Any thread may check and count new requests (`accept`), queue them (`add`)
and queue aborts; the loop's own thread takes the queue between steps, runs the same `Scheduler`
step that `Engine.generate` runs (a forward that raises fails only its request, as there), and
after every step calls `publish(items)` once with a (handle, Delta) pair for every request that
has news. The handle is whatever the caller gave `add` (a weak reference to a RequestStream in a
thread, the request's key in the engine process); the loop never looks inside it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable, Sequence

from backplane.scheduler.request import Req
from backplane.scheduler.sampling_params import SamplingParams
from backplane.text.stream import Delta

logger = logging.getLogger(__name__)

Publish = Callable[[list[tuple[Any, Delta]]], None]


class RequestRejected(ValueError):
    """A request that can never run (empty, too long, unknown adapter); the message says why."""


class QueueFullError(RuntimeError):
    """More requests are waiting than `max_queued_requests` allows; retry later."""


class EngineDeadError(RuntimeError):
    """The engine has stopped (shut down, its process died, or a tensor-parallel worker failed)."""


class _Tracked:
    """A submitted request as the loop sees it: how much of it has been published."""

    __slots__ = ("req", "handle", "num_sent", "started")

    def __init__(self, req: Req, handle: Any):
        self.req, self.handle, self.num_sent, self.started = req, handle, 0, False


class EngineLoop:
    """The loop over one Engine; `run()` blocks its thread until `stop` (or a fatal error)."""

    def __init__(self, engine: Any, publish: Publish, max_queued_requests: int | None = None):
        self.engine = engine
        self.scheduler = engine.scheduler
        self.publish = publish
        self.max_queued_requests = max_queued_requests
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._tracked: dict[Any, _Tracked] = {}  # the loop's thread only
        self._lock = threading.Lock()
        self._num_unstarted = 0  # accepted, not yet given a request row (under _lock)
        self.dead: str | None = None  # why the loop stopped

    # -- any thread -----------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Requests accepted that have no request row yet (queued here or in the scheduler)."""
        return self._num_unstarted

    @property
    def kv_usage(self) -> tuple[int, int]:
        """(slots requests hold, slots in the pool) of the KV pool; prefix-cache entries no request
        references count as free (eviction hands them out on demand)."""
        return self.scheduler.kv_usage

    @property
    def prefix_cache_stats(self) -> dict[str, Any]:
        """The radix cache's counters (Engine.stats()["prefix_cache"])."""
        return self.scheduler.prefix_cache.stats()

    def stats(self) -> dict[str, Any]:
        """What /metrics reads, in one dict (the engine process sends it to the server)."""
        return {"num_running": self.num_running, "num_waiting": self.num_waiting, "kv_usage": self.kv_usage,
                "prefix_cache": self.prefix_cache_stats}

    def accept(self, token_lists: list[list[int]], params: Sequence[SamplingParams], lora: str | None) -> list[Req]:
        """Check and count requests (all or none); raises RequestRejected naming the bad request,
        QueueFullError, or EngineDeadError. Queue the returned Reqs with `add`."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        # NOTE: Engine's request validation is shared on purpose: both entry points refuse the same.
        reqs = self.engine._make_requests(None, token_lists, list(params), lora)
        for req in reqs:
            error = req.error or self.scheduler.refusal(req)
            if error:
                raise RequestRejected(error)
        with self._lock:
            if self.max_queued_requests is not None and self._num_unstarted + len(reqs) > self.max_queued_requests:
                raise QueueFullError(f"{self._num_unstarted} requests are waiting, the limit is "
                                     f"{self.max_queued_requests} (--max-queued-requests); retry later")
            self._num_unstarted += len(reqs)
        return reqs

    def release(self, num: int) -> None:
        """Give back the queue places of `num` accepted requests that will never be added."""
        with self._lock:
            self._num_unstarted -= num

    def add(self, key: Any, req: Req, handle: Any) -> None:
        self._inbox.put(("add", key, req, handle))

    def abort(self, key: Any, message: str) -> None:
        """Abort a request: its KV slots and row are freed before the next step; its end is published."""
        self._inbox.put(("abort", key, message))

    def abort_all(self, message: str) -> None:
        self._inbox.put(("abort_all", message))

    def stop(self, message: str) -> None:
        """Abort every request in flight and end `run`."""
        self._inbox.put(("stop", message))

    def refuse_late_adds(self) -> None:
        """After `run` has ended: publish an abort for every request queued too late to be taken."""
        late = []
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item[0] == "add":
                late.append((item[3], Delta([], [], "abort", self.dead or "engine stopped", None, 0)))
        if late:
            self.publish(late)

    # -- the loop's thread ----------------------------------------------------------------------

    def run(self) -> None:
        try:
            while self._take_inbox(block=not self.scheduler.has_work):
                if self.scheduler.has_work:
                    self.engine._step()  # NOTE: Engine's step: a failing forward fails its request alone
                self._publish()
        except Exception as exc:  # noqa: BLE001 - a worker died or a bug: end every stream with the cause
            logger.exception("engine loop failed; every request in flight is aborted")
            self._stop(f"engine failed: {type(exc).__name__}: {exc}")

    def _take_inbox(self, block: bool) -> bool:
        """Apply queued adds and aborts; False once asked to stop."""
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if item[0] == "add":
                self._tracked[item[1]] = _Tracked(item[2], item[3])
                self.scheduler.add(item[2])  # aborts at once a request that can never fit
            elif item[0] == "abort":
                self._abort(item[1], item[2])
            elif item[0] == "abort_all":
                self._abort_tracked(item[1])
            else:
                self._stop(item[1])
                return False

    def _abort(self, key: Any, message: str) -> None:
        tracked = self._tracked.get(key)
        if tracked is not None and not tracked.req.finished:
            self.scheduler.abort(tracked.req, message)
            self._publish()

    def _stop(self, message: str) -> None:
        self.dead = message
        self._abort_tracked(message)

    def _abort_tracked(self, message: str) -> None:
        for tracked in self._tracked.values():
            if not tracked.req.finished:
                self.scheduler.abort(tracked.req, message)
        self._publish()

    def _publish(self) -> None:
        """One `publish` call per step with every request's new tokens (and its end)."""
        items: list[tuple[Any, Delta]] = []
        now = time.perf_counter()
        for key, tracked in list(self._tracked.items()):
            req = tracked.req
            self._note_started(tracked)
            if len(req.output_ids) == tracked.num_sent and not req.finished:
                continue
            items.append((tracked.handle, Delta(
                req.output_ids[tracked.num_sent:], req.logprobs[tracked.num_sent:],
                req.finish_reason.value if req.finished else None, req.error, req.text, len(req.output_ids), now)))
            tracked.num_sent = len(req.output_ids)
            if req.finished:
                del self._tracked[key]
        self.publish(items)

    def _note_started(self, tracked: _Tracked) -> None:
        if not tracked.started and (tracked.req.row is not None or tracked.req.finished):
            tracked.started = True
            with self._lock:
                self._num_unstarted -= 1
