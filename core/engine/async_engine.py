"""AsyncEngine: the Engine's scheduler driven by one background thread, with streaming and abort.

The thread owns the model: it takes new requests and aborts from a thread-safe inbox between
steps, runs the same `Scheduler` step that `Engine.generate` runs (a forward that raises fails
only its request, as there), and after every step hands each request's new tokens to the event
loop that submitted it. Callers, on any asyncio loop:

    engine = AsyncEngine(model="tiny-llama", device="cpu")
    stream = engine.add_request(input_ids=[1, 72, 105], params=SamplingParams(max_new_tokens=8))
    async for chunk in stream:           # StreamChunk: new token ids, logprobs and text
        print(chunk.text, end="")
    engine.shutdown()

`abort(rid)` frees the request's KV slots and request row before the next step starts; a stream
that is closed early (`await stream.aclose()`, or a cancelled consumer) aborts its request.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Sequence

from backplane.engine.engine import Engine
from backplane.engine.request import Req
from backplane.engine.sampling_params import SamplingParams
from backplane.engine.stream import Delta, RequestStream, StreamChunk

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "EngineDeadError", "QueueFullError", "RequestRejected", "RequestStream", "StreamChunk"]


class RequestRejected(ValueError):
    """A request that can never run (empty, too long, unknown adapter); the message says why."""


class QueueFullError(RuntimeError):
    """More requests are waiting than `max_queued_requests` allows; retry later."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shut down, or a tensor-parallel worker failed)."""


class _Tracked:
    """A submitted request as the engine thread sees it: how much of it the stream has been sent."""

    __slots__ = ("req", "stream", "num_sent", "started")

    def __init__(self, req: Req, stream: RequestStream):
        self.req, self.stream, self.num_sent, self.started = req, stream, 0, False


class AsyncEngine:
    """Streaming front of an `Engine`: keyword arguments are Engine's (EngineArgs fields, plugins).

    max_queued_requests: add_request raises QueueFullError while that many requests wait for a
    request row (None: no limit). `engine=` wraps an Engine already built (it must not be used
    for `generate` while this runs).
    """

    def __init__(self, model: str | None = None, *, engine: Engine | None = None,
                 max_queued_requests: int | None = None, **kwargs: Any):
        self.engine = engine or Engine(model, **kwargs)
        self.scheduler = self.engine.scheduler
        self.max_queued_requests = max_queued_requests
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._tracked: dict[int, _Tracked] = {}  # engine thread only
        self._lock = threading.Lock()
        self._num_unstarted = 0  # submitted, not yet given a request row (under _lock)
        self.dead: str | None = None  # why the engine thread stopped
        self._thread = threading.Thread(target=self._run, name="backplane-engine", daemon=True)
        self._thread.start()

    # -- any thread -----------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Requests accepted that have no request row yet (queued in the inbox or the scheduler)."""
        return self._num_unstarted

    @property
    def kv_usage(self) -> tuple[int, int]:
        """(slots requests hold, slots in the pool) of the KV pool; prefix-cache entries no request
        references count as free (eviction hands them out on demand)."""
        pool = self.scheduler.kv_pool
        return pool.num_slots - self.scheduler.prefix_cache.available(), pool.num_slots

    @property
    def prefix_cache_stats(self) -> dict[str, Any]:
        """The radix cache's counters (Engine.stats()["prefix_cache"])."""
        return self.scheduler.prefix_cache.stats()

    def add_request(self, input_ids: Sequence[int] | None = None, params: SamplingParams | None = None, *,
                    prompt: str | None = None, lora: str | None = None) -> RequestStream:
        """Submit one request; call on the event loop that will iterate the returned stream."""
        return self.add_requests([list(input_ids) if input_ids is not None else self._encode(prompt)],
                                 [params or SamplingParams()], lora=lora)[0]

    def add_requests(self, token_lists: list[list[int]], params: list[SamplingParams],
                     lora: str | None = None) -> list[RequestStream]:
        """Submit several requests at once (all or none: one that cannot run rejects the whole call).

        Raises RequestRejected naming the bad request, QueueFullError, or EngineDeadError.
        """
        import asyncio

        if self.dead is not None:
            raise EngineDeadError(self.dead)
        # NOTE: Engine's request validation is shared on purpose: both entry points refuse the same.
        reqs = self.engine._make_requests(None, token_lists, params, lora)
        for req in reqs:
            error = req.error or self.scheduler.refusal(req)
            if error:
                raise RequestRejected(error)
        with self._lock:
            if self.max_queued_requests is not None and self._num_unstarted + len(reqs) > self.max_queued_requests:
                raise QueueFullError(f"{self._num_unstarted} requests are waiting, the limit is "
                                     f"{self.max_queued_requests} (--max-queued-requests); retry later")
            self._num_unstarted += len(reqs)
        loop = asyncio.get_running_loop()
        streams = [RequestStream(req.rid, len(req.prompt_ids), req.created_at, loop, self.engine.decode,
                                 holdback=max((len(s) for s in req.params.stop), default=1) - 1,
                                 on_close=self._close_stream) for req in reqs]
        for req, stream in zip(reqs, streams):
            self._inbox.put(("add", req, stream))
        return streams

    def _encode(self, prompt: str | None) -> list[int]:
        if prompt is None:
            raise RequestRejected("add_request: pass input_ids or prompt")
        if self.tokenizer is None:
            raise RequestRejected(f"--model {self.engine.args.model}: has no tokenizer; pass input_ids")
        return list(self.tokenizer.encode(prompt))

    def abort(self, rid: int, message: str = "aborted by the client") -> None:
        """Abort a request: its KV slots and row are freed before the next step; its stream ends."""
        self._inbox.put(("abort", rid, message))

    def abort_all(self, message: str) -> None:
        """Abort every request in flight (thread-safe); the engine keeps serving new ones."""
        self._inbox.put(("abort_all", message))

    def _close_stream(self, stream: RequestStream) -> None:
        if self._thread.is_alive():
            self.abort(stream.rid)
        else:  # nobody left to publish the end: end the stream here
            stream.put(Delta([], [], "abort", self.dead or "engine stopped", None, len(stream.token_ids)))

    def shutdown(self, message: str = "the server is shutting down", timeout: float = 30.0) -> None:
        """Abort every request still in flight, stop the thread and the engine; idempotent."""
        if self._thread.is_alive():
            self._inbox.put(("stop", message))
            self._thread.join(timeout)
        self._refuse_late_adds()
        self.engine.shutdown()

    def _refuse_late_adds(self) -> None:
        """End the streams of requests that arrived after the thread stopped."""
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item[0] == "add":
                stream = item[2]
                delta = Delta([], [], "abort", self.dead or "engine stopped", None, 0)
                stream.loop.call_soon_threadsafe(stream.put, delta)

    # -- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._take_inbox(block=not self.scheduler.has_work):
                if self.scheduler.has_work:
                    self.engine._step()  # NOTE: Engine's step: a failing forward fails its request alone
                self._publish()
        except Exception as exc:  # noqa: BLE001 - a worker died or a bug: end every stream with the cause
            logger.exception("engine thread failed; every request in flight is aborted")
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
                self._admit(item[1], item[2])
            elif item[0] == "abort":
                self._abort(item[1], item[2])
            elif item[0] == "abort_all":
                self._abort_tracked(item[1])
            else:
                self._stop(item[1])
                return False

    def _admit(self, req: Req, stream: RequestStream) -> None:
        self._tracked[req.rid] = _Tracked(req, stream)
        self.scheduler.add(req)  # aborts at once a request that can never fit

    def _abort(self, rid: int, message: str) -> None:
        tracked = self._tracked.get(rid)
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
        """Send every request's new tokens (and its end) to its stream: one loop callback per
        event loop per step, however many streams that loop has (the loop fans them out)."""
        by_loop: dict[Any, list[tuple[RequestStream, Delta]]] = {}
        now = time.perf_counter()
        for rid, tracked in list(self._tracked.items()):
            req = tracked.req
            self._note_started(tracked)
            if len(req.output_ids) == tracked.num_sent and not req.finished:
                continue
            delta = Delta(req.output_ids[tracked.num_sent:], req.logprobs[tracked.num_sent:],
                          req.finish_reason.value if req.finished else None, req.error, req.text,
                          len(req.output_ids), now)
            tracked.num_sent = len(req.output_ids)
            by_loop.setdefault(tracked.stream.loop, []).append((tracked.stream, delta))
            if req.finished:
                del self._tracked[rid]
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the submitting loop is closed: nobody is listening
                pass

    def _note_started(self, tracked: _Tracked) -> None:
        if not tracked.started and (tracked.req.row is not None or tracked.req.finished):
            tracked.started = True
            with self._lock:
                self._num_unstarted -= 1


def _deliver(items: list[tuple[RequestStream, Delta]]) -> None:
    for stream, delta in items:
        stream.put(delta)
