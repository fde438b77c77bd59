"""RequestStream: one request's output as an async iterator of StreamChunks (see AsyncEngine)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable

from backplane.engine.detokenize import IncrementalText


@dataclass
class Delta:
    """What the engine thread sends after a step: the tokens new since the last Delta."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    error: str | None
    final_text: str | None  # the whole text when a stop string cut it
    num_output_tokens: int
    time: float = field(default_factory=time.perf_counter)


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

    Closing it before the end (`await stream.aclose()`) aborts the request.
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
        self._queue: asyncio.Queue[Delta] = asyncio.Queue()
        self._on_close = on_close
        self.closed = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def put(self, delta: Delta) -> None:
        """Called on `loop` (the engine thread schedules it there)."""
        self._queue.put_nowait(delta)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamChunk:
        if self.finished:
            raise StopAsyncIteration
        deltas = [await self._queue.get()]
        while not deltas[-1].finish_reason and not self._queue.empty():
            deltas.append(self._queue.get_nowait())
        return self._merge(deltas)

    def _merge(self, deltas: list[Delta]) -> StreamChunk:
        last = deltas[-1]
        new_ids = [t for d in deltas for t in d.token_ids]
        self.token_ids.extend(new_ids)
        self.finish_reason = last.finish_reason
        text = self._text.update(self.token_ids, finished=self.finished, final_text=last.final_text)
        return StreamChunk(new_ids, [lp for d in deltas for lp in d.logprobs], text, last.finish_reason,
                           last.error, self.num_prompt_tokens, last.num_output_tokens, last.time,
                           [d.time for d in deltas for _ in d.token_ids])

    def close(self) -> None:
        """Abort the request if it is still running (its KV is freed before the next step).

        The stream then ends with an "abort" chunk; safe to call more than once, from the loop.
        """
        if not self.finished and not self.closed:
            self.closed = True
            self._on_close(self)

    async def aclose(self) -> None:
        self.close()
