"""The messages between `backplane serve`'s server (process_engine.py) and its engine process
(engine_process.py), one Pipe between them. Each is a frozen dataclass; the receiving side
dispatches on its type.

Server -> engine: `AddRequests` (answered by one `Verdict` before any `Step` carries its keys),
`Abort`, `AbortAll`, `Stop`.
Engine -> server: `Ready` or `Failed` once at startup, then `Verdict`s and one `Step` per engine
step that has news (a `StepRow` per request), and `Stopped` last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

# -- server -> engine ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AddRequests:
    """Requests to check and queue, all or none; `keys` name them in later messages."""

    batch: int
    keys: list[int]
    token_lists: list[list[int]]
    params: list[Any]  # SamplingParams
    lora: str | None = None


@dataclass(frozen=True, slots=True)
class Abort:
    """Abort one request: its KV is freed before the engine's next step."""

    key: int
    message: str


@dataclass(frozen=True, slots=True)
class AbortAll:
    message: str


@dataclass(frozen=True, slots=True)
class Stop:
    """Abort every request in flight and end the engine process."""

    message: str


# -- engine -> server ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ready:
    """The engine is built: what the server needs to load the same tokenizer and answer /v1/models.

    tokenizer: (model directory or None, vocabulary size, --tokenizer-path), load_tokenizer's arguments.
    """

    pid: int
    context_len: int
    tokenizer: tuple[Any, int, str | None]
    stats: dict[str, Any]
    gc_frozen: int = 0  # objects the engine process moved to the permanent generation (freeze_startup_heap)


@dataclass(frozen=True, slots=True)
class Failed:
    """The engine could not start; `error` is the exception itself when it pickles."""

    error: BaseException


@dataclass(frozen=True, slots=True)
class Verdict:
    """The answer to AddRequests `batch`: kind None (accepted) or the refusal's class name."""

    batch: int
    kind: str | None = None
    message: str | None = None


class StepRow(NamedTuple):
    """One request's news in a Step: its new tokens, and its end when finish_reason is set."""

    key: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    error: str | None
    final_text: str | None
    num_output_tokens: int


@dataclass(frozen=True, slots=True)
class Step:
    """One engine step's news: `time` (perf_counter) of its end, the rows, and EngineLoop.stats()
    when due (at most every STATS_INTERVAL_S, and whenever the engine goes idle), else None."""

    time: float
    rows: list[StepRow]
    stats: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Stopped:
    """The loop has ended (why, or None); the process exits next."""

    reason: str | None
