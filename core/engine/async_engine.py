"""AsyncEngine: the Engine's scheduler driven by one background thread, with streaming and abort.

The thread runs an `EngineLoop` (engine_loop.py): it takes new requests and aborts between
steps and after every step hands each request's new tokens to the event loop that submitted it.
Callers, on any asyncio loop:

    engine = AsyncEngine(model="tiny-llama", device="cpu")
    stream = engine.add_request(input_ids=[1, 72, 105], params=SamplingParams(max_new_tokens=8))
    async for chunk in stream:           # StreamChunk: new token ids, logprobs and text
        print(chunk.text, end="")
    engine.shutdown()

`abort(rid)` frees the request's KV slots and request row before the next step starts; a stream
that is closed early (`await stream.aclose()`), whose consumer task is cancelled, or that is dropped
unfinished (a `break` out of `async for`, the stream then unreferenced) aborts its request.
While it runs, the wrapped Engine refuses `generate` (the thread owns its scheduler); an
AsyncEngine dropped without `shutdown()` stops its thread when it is garbage collected.
`backplane serve` runs the same loop in a process of its own instead (process_engine.py), behind
the same interface; `--engine-in-thread` picks this class.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Sequence

from backplane.engine.engine import Engine
from backplane.engine.engine_loop import EngineDeadError, EngineLoop, QueueFullError, RequestRejected
from backplane.scheduler.sampling_params import SamplingParams
from backplane.text.stream import Delta, RequestStream, StreamChunk, deliver_by_loop, stop_holdback

__all__ = ["AsyncEngine", "EngineDeadError", "QueueFullError", "RequestRejected", "RequestStream", "StreamChunk"]


class AsyncEngine:
    """Streaming front of an `Engine`: keyword arguments are Engine's (EngineArgs fields, plugins).

    max_queued_requests: add_request raises QueueFullError while that many requests wait for a
    request row (None: no limit). `engine=` wraps an Engine already built (it must not be used
    for `generate` while this runs).
    """

    def __init__(self, model: str | None = None, *, engine: Engine | None = None,
                 max_queued_requests: int | None = None, **kwargs: Any):
        self.engine = engine or Engine(model, **kwargs)
        self.engine.take_over("an AsyncEngine")
        self.scheduler = self.engine.scheduler
        # NOTE: nothing the thread holds refers back to this object or to a stream (the loop keeps
        # weak references to them), so dropping either is seen: see _finalize and _deliver_live.
        self.engine_loop = EngineLoop(self.engine, _deliver_live, max_queued_requests)
        self.pid = os.getpid()  # where the engine runs (the engine process's, in process_engine.py)
        self._thread = threading.Thread(target=self.engine_loop.run, name="backplane-engine", daemon=True)
        self._thread.start()
        self._finalizer = weakref.finalize(self, _finalize, self.engine_loop, self.engine)

    # -- any thread -----------------------------------------------------------------------------

    @property
    def dead(self) -> str | None:
        """Why the engine thread stopped, or None while it runs."""
        return self.engine_loop.dead

    @property
    def args(self) -> Any:
        return self.engine.args

    @property
    def context_len(self) -> int:
        return self.engine.runner.context_len

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def decode(self, ids: list[int]) -> str:
        return self.engine.decode(ids)

    @property
    def num_running(self) -> int:
        return self.engine_loop.num_running

    @property
    def num_waiting(self) -> int:
        """Requests accepted that have no request row yet (queued in the inbox or the scheduler)."""
        return self.engine_loop.num_waiting

    @property
    def kv_usage(self) -> tuple[int, int]:
        """(slots requests hold, slots in the pool) of the KV pool (see EngineLoop.kv_usage)."""
        return self.engine_loop.kv_usage

    @property
    def prefix_cache_stats(self) -> dict[str, Any]:
        """The radix cache's counters (Engine.stats()["prefix_cache"])."""
        return self.engine_loop.prefix_cache_stats

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

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError("AsyncEngine.add_request: expected to be called on a running asyncio event loop "
                               "(the loop that iterates the stream), got none; await start_requests() in a "
                               "coroutine, or use Engine.generate from synchronous code") from None
        reqs = self.engine_loop.accept(token_lists, params, lora)
        try:
            streams = [RequestStream(req.rid, len(req.prompt_ids), req.created_at, loop, self.engine.decode,
                                     stop_holdback(req.params), on_close=self._close_stream) for req in reqs]
        except BaseException:
            self.engine_loop.release(len(reqs))  # accepted, never queued: give back their queue places
            raise
        for req, stream in zip(reqs, streams):
            self.engine_loop.add(req.rid, req, weakref.ref(stream))
        return streams

    async def start_requests(self, token_lists: list[list[int]], params: list[SamplingParams],
                             lora: str | None = None) -> list[RequestStream]:
        """add_requests, awaitable: the interface the server uses (process_engine.py's must wait)."""
        return self.add_requests(token_lists, params, lora)

    def _encode(self, prompt: str | None) -> list[int]:
        if prompt is None:
            raise RequestRejected("add_request: pass input_ids or prompt")
        if self.tokenizer is None:
            raise RequestRejected(f"--model {self.engine.args.model}: has no tokenizer; pass input_ids")
        return list(self.tokenizer.encode(prompt))

    def abort(self, rid: int, message: str = "aborted by the client") -> None:
        """Abort a request: its KV slots and row are freed before the next step; its stream ends."""
        self.engine_loop.abort(rid, message)

    def abort_all(self, message: str) -> None:
        """Abort every request in flight (thread-safe); the engine keeps serving new ones."""
        self.engine_loop.abort_all(message)

    def _close_stream(self, stream: RequestStream) -> None:
        if self._thread.is_alive():
            self.abort(stream.rid)
        else:  # nobody left to publish the end: end the stream here
            stream.put(Delta([], [], "abort", self.dead or "engine stopped", None, len(stream.token_ids)))

    def shutdown(self, message: str = "the server is shutting down", timeout: float = 30.0) -> None:
        """Abort every request still in flight, stop the thread and the engine; idempotent."""
        self._finalizer.detach()
        if self._thread.is_alive():
            self.engine_loop.stop(message)
            self._thread.join(timeout)
        self.engine_loop.refuse_late_adds()
        self.engine.hand_back()
        self.engine.shutdown()


def _deliver_live(items: list[tuple[Any, Delta]]) -> None:
    """The loop's publish: (weak reference to a stream, Delta) pairs to the streams still alive."""
    deliver_by_loop([(stream, delta) for ref, delta in items if (stream := ref()) is not None])


def _finalize(engine_loop: EngineLoop, engine: Engine) -> None:
    """An AsyncEngine dropped without shutdown(): stop its thread (it exits after the step it is
    in), so the thread and the engine are freed; the engine may serve `generate` again."""
    engine_loop.stop("the AsyncEngine was dropped without shutdown()")
    engine.hand_back()
