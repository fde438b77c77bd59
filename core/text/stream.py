"""RequestStream: one request's output as an async iterator of StreamChunks (see AsyncEngine).

The engine loop's publisher (its thread, or the server's reader of the engine process) hands
each event loop one callback per step for all of that loop's streams; `put` only appends to a
list and wakes the consumer, and the consumer takes every delta that came since its last chunk
in one go (a consumer slower than the engine gets fewer, bigger chunks).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from backplane.text.detokenize import IncrementalText


@dataclass
class Delta:
    """What the engine loop publishes after a step: the tokens new since the last Delta."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    error: str | None
    final_text: str | None  # the whole text when a stop string cut it
    num_output_tokens: int
    time: float = field(default_factory=time.perf_counter)  # the step's end (one clock read per step)


@dataclass
class StreamChunk:
    """New output of one request since the previous chunk; the last chunk has finish_reason set.

    finish_reason: "stop", "length" or "abort" (then `error` says why). Several engine steps are
    merged into one chunk when the consumer is slower than the engine; token_times holds, per
    token, the time.perf_counter() of the step that produced it, and `time` that of the newest step.
    """

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str | None
    error: str | None
    num_prompt_tokens: int
    num_output_tokens: int  # so far, this chunk included
    time: float
    token_times: list[float]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestStream:
    """Async iterator of one request's StreamChunks; ends after the chunk that has finish_reason.

    Closing it before the end (`await stream.aclose()`) aborts the request, and so do a consumer
    cancelled while it waits for a chunk and a stream dropped unfinished (after a `break` out of
    `async for`, once nothing refers to it): `on_close` is called once in each case.
    """

    def __init__(self, rid: int, num_prompt_tokens: int, created_at: float, loop: asyncio.AbstractEventLoop,
                 decode: Callable[[list[int]], str], holdback: int,
                 on_close: Callable[[RequestStream], None]):
        self.rid = rid
        self.num_prompt_tokens = num_prompt_tokens
        self.created_at = created_at  # time.perf_counter() at submission
        self.loop = loop
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self._text = IncrementalText(decode, holdback)
        self._pending: list[Delta] = []  # put on `loop`, not yet merged into a chunk
        self._waiter: asyncio.Future[None] | None = None  # the consumer, while it waits
        self._on_close = on_close
        self.closed = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def put(self, delta: Delta) -> None:
        """Called on `loop` (deliver_by_loop schedules it there)."""
        self._pending.append(delta)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamChunk:
        if self.finished:
            raise StopAsyncIteration
        while not self._pending:
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            except asyncio.CancelledError:  # the consumer is cancelled: nobody will read the rest
                self.close()
                raise
            finally:
                self._waiter = None
        return self._merge(self._take())

    def _take(self) -> list[Delta]:
        """The pending deltas up to the first that ends the request (only a late abort from
        `close` can follow it, so when the newest has no finish_reason none has)."""
        pending = self._pending
        if len(pending) == 1 or not pending[-1].finish_reason:
            self._pending = []
            return pending
        end = next(i + 1 for i, d in enumerate(pending) if d.finish_reason)
        taken, self._pending = pending[:end], pending[end:]
        return taken

    def _merge(self, deltas: list[Delta]) -> StreamChunk:
        last = deltas[-1]
        if len(deltas) == 1:  # the usual case: one step since the previous chunk
            new_ids, logprobs, times = last.token_ids, last.logprobs, [last.time] * len(last.token_ids)
        else:
            new_ids = [t for d in deltas for t in d.token_ids]
            logprobs = [lp for d in deltas for lp in d.logprobs]
            times = [d.time for d in deltas for _ in d.token_ids]
        self.token_ids.extend(new_ids)
        self.finish_reason = last.finish_reason
        text = self._text.update(self.token_ids, finished=self.finished, final_text=last.final_text)
        return StreamChunk(new_ids, logprobs, text, last.finish_reason, last.error, self.num_prompt_tokens,
                           last.num_output_tokens, last.time, times)

    def close(self) -> None:
        """Abort the request if it is still running (its KV is freed before the next step).

        The stream then ends with an "abort" chunk; safe to call more than once, from the loop.
        """
        if not self.finished and not self.closed:
            self.closed = True
            self._on_close(self)

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:
        # NOTE: an `async for` left by `break` never closes its iterator; the last reference going is
        # the only sign. on_close must be safe in any thread (the engines' only queue or send).
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finaliser (interpreter shutdown)
            pass


def stop_holdback(params: Any) -> int:
    """Characters a stream keeps back while they might begin one of the request's stop strings."""
    return max((len(s) for s in params.stop), default=1) - 1


def deliver_by_loop(items: list[tuple[RequestStream, Delta]]) -> None:
    """Hand (stream, Delta) pairs to their streams from any thread: one callback per event loop,
    however many streams that loop has (each callback costs a wake-up of the loop)."""
    by_loop: dict[Any, list[tuple[RequestStream, Delta]]] = {}
    for stream, delta in items:
        by_loop.setdefault(stream.loop, []).append((stream, delta))
    for loop, group in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver, group)
        except RuntimeError:  # the submitting loop is closed: nobody is listening
            pass


def _deliver(items: list[tuple[RequestStream, Delta]]) -> None:
    for stream, delta in items:
        stream.put(delta)
