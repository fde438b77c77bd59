"""The client Protocols of the engines: what a caller (the server, a benchmark) may rely on.

`EngineClient` is shared by all three engines: `Engine` (blocking `generate`), `AsyncEngine` (the
scheduler on a thread of this process) and `ProcessEngine` (the scheduler in a process of its
own). `StreamingEngineClient` adds streaming requests and aborts; AsyncEngine and ProcessEngine
implement it, and `backplane serve` is written against it, so either can serve.

Both are runtime_checkable: `isinstance(engine, StreamingEngineClient)` checks that every member
is there (not their signatures; the tests in tests/engine/test_client.py call them).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class EngineClient(Protocol):
    """What every engine offers: its settings, tokenizer, load and lifetime.

    args: the EngineArgs it was built from; tokenizer: its tokenizer (None: token ids only);
    context_len: the longest prompt plus output it serves; pid: the process the scheduler runs in;
    dead: why the engine stopped, or None while it serves; num_running: requests holding a request
    row; num_waiting: requests accepted without one; kv_usage: (KV slots requests hold, slots in the
    pool); prefix_cache_stats: the radix cache's counters.
    """

    args: Any
    tokenizer: Any
    context_len: int
    pid: int

    @property
    def dead(self) -> str | None: ...

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def kv_usage(self) -> tuple[int, int]: ...

    @property
    def prefix_cache_stats(self) -> dict[str, Any]: ...

    def decode(self, ids: list[int]) -> str:
        """The text of `ids` as the engine reports it (special tokens skipped)."""
        ...

    def shutdown(self) -> None:
        """Stop serving and release the engine (workers, threads, processes); idempotent."""
        ...


@runtime_checkable
class StreamingEngineClient(EngineClient, Protocol):
    """An engine that serves requests as streams (AsyncEngine, ProcessEngine): the server's engine."""

    async def start_requests(self, token_lists: list[list[int]], params: list[Any],
                             lora: str | None = None) -> list[Any]:
        """Submit requests (all or none); one RequestStream each, in order. Raises RequestRejected,
        QueueFullError or EngineDeadError (backplane.engine.engine_loop)."""
        ...

    def abort(self, rid: int, message: str = "aborted by the client") -> None:
        """Abort a request: its KV is freed before the next step and its stream ends with "abort"."""
        ...

    def abort_all(self, message: str) -> None:
        """Abort every request in flight (any thread); the engine keeps serving new ones."""
        ...
