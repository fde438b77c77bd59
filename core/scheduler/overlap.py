"""Overlap scheduling: the host builds step N+1 while the device runs step N.

Sampled tokens stay on the device. A request whose last token is still in flight gets a negative
placeholder as its next input id (`FutureTokens`); the device resolves it from the future buffer
just before the forward, so no step waits for the previous one's tokens on the host. Each step
copies its tokens and their log-probabilities to the host (into one pinned buffer, behind an event;
one copy when the sampler returned them packed so in one device buffer),
which the host reads only after the next step is launched. Stop checks
therefore lag by one step: a request that stopped at step N may have run in step N+1; that token
is discarded and its KV slot is freed with the request's others. On CPU the same code runs, each
step's tokens read at once.

The loop itself is `Scheduler.step`: launch the next batch, then read the previous `LaunchedStep`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from backplane.scheduler.request import Req


class FutureTokens:
    """A ring of device slots for sampled tokens not yet read on the host.

    Placeholder -k (k >= 1) names slot k. A placeholder is only read by the step launched right
    after the one that wrote it, so a ring of a few batches' worth of slots never wraps onto a live
    one. tokens: [capacity + 1] int64 on `device` (slot 0 unused). Under tensor parallelism only
    rank 0 has a ring: the other ranks get its resolved input ids on the device
    (backplane.distributed.batch_sync.send_input_ids).
    """

    def __init__(self, max_tokens_per_step: int, device: torch.device):
        self.capacity = 4 * max(max_tokens_per_step, 1)
        self.tokens = torch.zeros(self.capacity + 1, dtype=torch.int64, device=device)
        self._next = 1
        self._latest: dict[int, int] = {}  # request id -> placeholder of its newest in-flight token

    def store(self, reqs: list[Req], tokens: torch.Tensor) -> None:
        """Keep `tokens` [len(reqs)] on the device and hand each request a placeholder for its token."""
        n = len(reqs)
        if self._next + n > self.capacity + 1:
            self._next = 1
        start = self._next
        self.tokens[start:start + n].copy_(tokens)
        for i, req in enumerate(reqs):
            self._latest[req.rid] = -(start + i)
        self._next += n

    def placeholder(self, req: Req) -> int:
        return self._latest[req.rid]

    def forget(self, req: Req) -> None:
        self._latest.pop(req.rid, None)

    def resolve(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [n] int64 on the device, placeholders replaced by their tokens (a device op)."""
        return torch.where(input_ids < 0, self.tokens[(-input_ids).clamp_min(0)], input_ids)


@dataclass
class LaunchedStep:
    """One step whose sampled tokens are on their way to the host.

    reqs: the requests that sampled a token, in order; tokens [len(reqs)] int64 and logprobs
    [len(reqs)] (the sampler's dtype) on the host, in pinned memory, valid once `event` has
    completed; or `known`: the tokens already read (on CPU, and under speculation).
    """

    reqs: list[Req]
    tokens: torch.Tensor | None
    logprobs: torch.Tensor | None = None
    event: torch.cuda.Event | None = None
    known: list[tuple[list[int], list[float]]] | None = None  # tokens already on the host

    @classmethod
    def known_tokens(cls, reqs: list[Req], new: list[tuple[list[int], list[float]]]) -> LaunchedStep:
        """A step whose tokens (several per request under speculation) were read synchronously."""
        return cls(reqs, None, known=new)

    @classmethod
    def launch(cls, reqs: list[Req], tokens: torch.Tensor, logprobs: torch.Tensor) -> LaunchedStep:
        """Start the copy of tokens [len(reqs)] int64 and logprobs [len(reqs)] to the host.

        On CUDA: non-blocking copies into one pinned buffer, then an event; no kernel (no cast on
        the device). One copy when the two are views of one device buffer laid out as the host
        buffer is (`packed_span`: what the Triton `greedy_sample` returns), else one each.
        Elsewhere the tensors are host tensors: read at once.
        """
        if tokens.device.type != "cuda":
            return cls.known_tokens(reqs, _one_each(tokens.tolist(), logprobs.tolist()))
        host_tokens, host_logprobs = copy_to_host(tokens, logprobs, pin_memory=True)
        event = torch.cuda.Event()
        event.record()
        return cls(reqs, host_tokens, host_logprobs, event)

    def new_tokens(self) -> Sequence[tuple[list[int], list[float]]]:
        """Wait for the copy; per request its new token ids and their log-probabilities (a `OneEach`
        when each request has one)."""
        if self.known is not None:
            return self.known
        self.event.synchronize()
        return _one_each(self.tokens.tolist(), self.logprobs.tolist())


def _logprobs_start(tokens: torch.Tensor) -> int:
    """Byte offset of the log-probabilities after tokens, in the host buffer and in a packed one."""
    # NOTE: 16-byte aligned, for any dtype (a kernel writing both sees an aligned pointer for every count)
    return -(-tokens.numel() * tokens.element_size() // 16) * 16


def packed_span(tokens: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor | None:
    """The bytes from tokens' start to logprobs' end as one uint8 view, when tokens and logprobs are
    contiguous views of one storage with logprobs at `_logprobs_start` bytes after tokens (the host
    buffer's layout); else None. No device work: a view of the same storage."""
    if not (tokens.is_contiguous() and logprobs.is_contiguous()) or tokens.numel() == 0:
        return None
    start = _logprobs_start(tokens)
    if (logprobs.data_ptr() - tokens.data_ptr() != start
            or tokens.untyped_storage().data_ptr() != logprobs.untyped_storage().data_ptr()):
        return None
    return tokens.view(torch.uint8).as_strided((start + logprobs.numel() * logprobs.element_size(),), (1,))


def copy_to_host(tokens: torch.Tensor, logprobs: torch.Tensor, pin_memory: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-blocking copies of tokens [n] and logprobs [n] into one new host buffer; its two views.

    One copy when `packed_span` finds them packed, else two. The caller waits (an event) before
    reading them.
    """
    start = _logprobs_start(tokens)
    host = torch.empty(start + logprobs.numel() * logprobs.element_size(), dtype=torch.uint8, pin_memory=pin_memory)
    host_tokens = host[:tokens.numel() * tokens.element_size()].view(tokens.dtype)
    host_logprobs = host[start:].view(logprobs.dtype)
    span = packed_span(tokens, logprobs)
    if span is not None:
        host.copy_(span, non_blocking=True)
    else:
        host_tokens.copy_(tokens, non_blocking=True)
        host_logprobs.copy_(logprobs, non_blocking=True)
    return host_tokens, host_logprobs


def _one_each(tokens: list[int], logprobs: list[float]) -> OneEach:
    """Per request, its one new token and log-probability."""
    return OneEach(tokens, logprobs)


class OneEach(Sequence):
    """A plain decode step's new tokens: per request ([token], [log-probability]), as `new_tokens`
    returns them, kept as the two flat lists (`tokens`, `logprobs`) the host read. A reader of a
    large batch (`Scheduler._advance`) takes them directly instead of one pair of lists per request."""

    __slots__ = ("tokens", "logprobs")

    def __init__(self, tokens: list[int], logprobs: list[float]):
        assert len(tokens) == len(logprobs), f"OneEach: {len(tokens)} tokens but {len(logprobs)} log-probabilities"
        self.tokens, self.logprobs = tokens, logprobs

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return list(zip(([t] for t in self.tokens[i]), ([lp] for lp in self.logprobs[i])))
        return [self.tokens[i]], [self.logprobs[i]]

    def __iter__(self):
        return zip(([t] for t in self.tokens), ([lp] for lp in self.logprobs))

    def __eq__(self, other) -> bool:
        if isinstance(other, (list, tuple, OneEach)):
            return list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"OneEach({list(self)!r})"
