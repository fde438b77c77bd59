"""One HTTP generation request: submit its outputs to the engine, then stream or collect them.

The n outputs of every prompt run as separate engine requests, merged here into one response.
A client that goes away (the connection closes, or the server cancels the handler) aborts every
output still running, so its KV slots are freed before the engine's next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from dataclasses import dataclass
from typing import Any, AsyncIterator

from backplane.engine.async_engine import EngineDeadError, QueueFullError, RequestRejected
from backplane.engine.client import StreamingEngineClient
from backplane.server.errors import ApiError, error_body
from backplane.server.openai_format import Choice, Formatter, sse

RETRY_AFTER_S = "1"
SHUTDOWN_MESSAGE = "the server is shutting down"  # the abort reason of requests cut by SIGTERM
DONE_EVENT = b"data: [DONE]\n\n"
_REQUEST_ID = re.compile(r"^request \d+: ")  # the engine's own request counter, meaningless to a client


def rejection(message: str) -> ApiError:
    """A 400 for a request the engine refuses, in the API's words: `max_tokens`, not the engine's
    `max_new_tokens` (and then that is the param at fault), without the engine's request number."""
    message = _REQUEST_ID.sub("", message)
    param = "max_tokens" if "max_new_tokens" in message else "prompt"
    return ApiError(400, message.replace("max_new_tokens", "max_tokens"), param)


def _failure_status(error: str | None) -> int:
    return 503 if error == SHUTDOWN_MESSAGE else 500


@dataclass
class Generation:
    streams: list[Any]
    choices: list[Choice]
    formatter: Formatter
    n: int
    include_usage: bool
    timers: list[Any]


async def submit(engine: StreamingEngineClient, metrics: Any, prompts: list[list[int]], params: list[list[Any]], lora: str | None,
           formatter: Formatter, n: int, include_usage: bool, return_prompt: bool) -> Generation:
    """Start every output; map the engine's refusals to 400 / 503."""
    flat = [(ids, p) for ids, ps in zip(prompts, params) for p in ps]
    try:
        streams = await engine.start_requests([ids for ids, _ in flat], [p for _, p in flat], lora=lora)
    except RequestRejected as err:
        raise rejection(str(err)) from None
    except QueueFullError as err:
        raise ApiError(503, str(err), headers={"Retry-After": RETRY_AFTER_S}) from None
    except EngineDeadError as err:
        raise ApiError(503, f"the engine has stopped: {err}") from None
    choices = [Choice(i, len(ids), list(ids) if return_prompt else None) for i, (ids, _) in enumerate(flat)]
    timers = [metrics.timer(s) for s in streams]
    return Generation(streams, choices, formatter, n, include_usage, timers)


async def merged(gen: Generation) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, StreamChunk) in arrival order until every output has finished."""
    if len(gen.streams) == 1:
        async for chunk in gen.streams[0]:
            yield 0, chunk
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: Any) -> None:
        async for chunk in stream:
            queue.put_nowait((i, chunk))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(gen.streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, chunk = await queue.get()
            remaining -= chunk.finish_reason is not None
            yield i, chunk
    finally:
        for task in tasks:
            task.cancel()


@contextlib.asynccontextmanager
async def abort_on_disconnect(request: Any, gen: Generation):
    """Abort the generation's unfinished outputs when the client disconnects or the handler ends."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        close(gen)

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()
        close(gen)


def close(gen: Generation) -> None:
    for stream, timer in zip(gen.streams, gen.timers):
        if not stream.finished:
            stream.close()
            timer.on_abandoned()


async def collect(request: Any, gen: Generation) -> dict[str, Any]:
    """The whole response; an output that failed in the engine makes it a 500 naming the cause."""
    async with abort_on_disconnect(request, gen), contextlib.aclosing(merged(gen)) as chunks:
        async for i, chunk in chunks:
            gen.choices[i].add(chunk)
            gen.timers[i].on_chunk(chunk)
    failed = next((c for c in gen.choices if c.finish_reason == "abort"), None)
    if failed is not None:
        raise ApiError(_failure_status(failed.error), failed.error or "request aborted")
    return gen.formatter.response(gen.choices, gen.n)


async def event_stream(request: Any, gen: Generation) -> AsyncIterator[bytes]:
    """Server-sent events: one `data: {json}` per chunk, usage last if asked, then `data: [DONE]`.

    The last chunk, the usage and `[DONE]` go out as one write, as do an error event and `[DONE]`.
    """
    started = [False] * len(gen.choices)
    num_finished, tail = 0, b""
    async with abort_on_disconnect(request, gen), contextlib.aclosing(merged(gen)) as chunks:
        async for i, chunk in chunks:
            choice = gen.choices[i]
            choice.add(chunk)
            gen.timers[i].on_chunk(chunk)
            if chunk.finish_reason == "abort":
                tail = sse(error_body(_failure_status(chunk.error), chunk.error or "request aborted"))
                break
            event = b""
            if chunk.text or chunk.token_ids or chunk.finish_reason or not started[i]:
                event = gen.formatter.chunk_event(choice, chunk, first=not started[i])
                started[i] = True
            num_finished += chunk.finish_reason is not None
            if num_finished < len(gen.choices):
                if event:
                    yield event
            else:  # the last chunk of the last output: the loop ends here
                tail = event + (sse(gen.formatter.usage_chunk(gen.choices, gen.n)) if gen.include_usage else b"")
    yield tail + DONE_EVENT
