"""Req: one request's state as the scheduler moves it from waiting to finished."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from backplane.scheduler.sampling_params import SamplingParams


class FinishReason(str, enum.Enum):
    STOP = "stop"  # end-of-sequence token, a stop token or a stop string
    LENGTH = "length"  # max_new_tokens reached
    ABORT = "abort"  # rejected or failed; `error` says why


@dataclass
class Req:
    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    lora: str | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    text: str | None = None  # set when a stop string cut the output text
    # KV state: the request-pool row and the slots of the first `num_cached` tokens.
    row: int | None = None
    slots: list[torch.Tensor] = field(default_factory=list)
    num_cached: int = 0
    # Prefix cache: the first `num_shared` slots belong to the radix tree, referenced at prefix_node.
    num_shared: int = 0
    prefix_node: Any = None
    generator: torch.Generator | None = None
    spec_state: Any = None
    stop_strings: Any = None  # the stop strings' matcher (stopping.StopStrings), built at the first check
    # time.perf_counter() when the request was created, got its first token, and finished
    created_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def all_ids(self) -> list[int]:
        """Prompt then output ids: a new list (a copy); per-step code uses num_tokens and token_at."""
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        """len(all_ids), without building the list."""
        return len(self.prompt_ids) + len(self.output_ids)

    def token_at(self, i: int) -> int:
        """all_ids[i] for 0 <= i < num_tokens, without building the list."""
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    def ids_between(self, start: int, stop: int) -> list[int]:
        """all_ids[start:stop] (0 <= start <= stop), copying only that slice."""
        n = len(self.prompt_ids)
        if stop <= n:
            return self.prompt_ids[start:stop]
        return self.prompt_ids[start:] + self.output_ids[max(start - n, 0):stop - n]

    @property
    def next_token_is_last(self) -> bool:
        """Whether one more token after output_ids reaches max_new_tokens: with it in flight, no
        later step may run for this request."""
        return len(self.output_ids) + 1 >= self.params.max_new_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def needs_prefill(self) -> bool:
        """True until every token but the last generated one has its KV in the pool."""
        output_ids = self.output_ids  # NOTE: num_tokens inlined: read for every running request every step
        return self.num_cached < len(self.prompt_ids) + len(output_ids) - (1 if output_ids else 0)

    def abort(self, message: str) -> None:
        self.finish_reason = FinishReason.ABORT
        self.error = message


@dataclass
class RequestOutput:
    """What `Engine.generate` returns per request: generated token ids (prompt excluded), text,
    finish reason ("stop", "length" or "abort"), the chosen tokens' log-probabilities, for an
    aborted request the error, and under speculative decoding its acceptance."""

    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[float]
    prompt_token_ids: list[int]
    error: str | None = None
    ttft_s: float | None = None  # time to first token, from the request's arrival (seconds)
    tpot_s: float | None = None  # mean time per output token after the first (seconds)
    # Under speculative decoding: steps, accepted_drafts, tokens, mean_acceptance_length (None otherwise).
    speculative: dict[str, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        # NOTE: JSON has no NaN: a log-probability that is not finite (a model gone NaN) is null.
        logprobs = [lp if math.isfinite(lp) else None for lp in self.logprobs]
        out = {"token_ids": self.token_ids, "text": self.text, "finish_reason": self.finish_reason,
               "logprobs": logprobs}
        if self.error:
            out["error"] = self.error
        if self.speculative is not None:
            out["speculative"] = self.speculative
        return out
