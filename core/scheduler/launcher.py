"""Running the batch the scheduler chose: build it, let the participants describe it, forward it
(through the speculative worker when there is one), sample on the device and start the copy of
the tokens to the host (a `LaunchedStep`, read by the scheduler one step later under overlap).

A prefill batch whose every request computes one new token (a fully cached prompt's last token, a
chunked prompt's last chunk of one) is a decode step and runs as one (`prefill_runs_as_decode`).
"""

from __future__ import annotations

from typing import Any

import torch

from backplane.contracts.batch import ForwardBatch
from backplane.contracts.protocols import SchedulerParticipant
from backplane.layers.sampler import sample
from backplane.ops import native
from backplane.scheduler.batch_builder import build_decode_batch, build_extend_batch
from backplane.scheduler.decode_state import DecodeState
from backplane.scheduler.overlap import FutureTokens, LaunchedStep
from backplane.scheduler.request import Req
from backplane.scheduler.sampling_state import SamplingCache
from backplane.speculative.worker import SpecWorker


class BatchLauncher:
    """Forwards and samples prefill and decode batches over one model runner's pools.

    participants describe every batch before it runs (`prepare_batch(batch, reqs)`); spec_worker,
    if any, replaces the plain decode step; future (overlap only) keeps each step's sampled tokens
    on the device for the next step's inputs; generator: the shared sampling generator (requests
    with a seed bring their own).
    """

    def __init__(self, runner, participants: list[SchedulerParticipant], *, spec_worker: Any = None,
                 future: FutureTokens | None = None, generator: torch.Generator):
        self.runner = runner
        self.kv_pool = runner.token_to_kv_pool
        self.req_pool = runner.req_to_token_pool
        self.participants = participants
        self.spec_worker = spec_worker
        self.future = future
        self.generator = generator
        self.sampling = SamplingCache()
        # Plain decode batches: advanced in place while the same requests decode step after step.
        self.decode_state = DecodeState(self.kv_pool, self.req_pool, future)

    @property
    def greedy_sample(self):
        """What an all-greedy batch samples with: the `greedy_sample` op chosen for the runner's device
        (its model_ctx's op table), or the native op for a runner without one (a stand-in that only forwards)."""
        ctx = getattr(self.runner, "model_ctx", None)
        return native.greedy_sample if ctx is None else ctx.default_ops.greedy_sample

    def forward_prefill(self, reqs: list[Req], chunks: list[int]) -> torch.Tensor:
        """Prefill the next `chunks[i]` tokens of each request (advancing its num_cached); the
        logits [len(reqs), vocab] of each request's last token in the batch. An EXTEND batch, or
        the DECODE batch it equals when `prefill_runs_as_decode`; the caller's bookkeeping is the same."""
        if self.prefill_runs_as_decode(reqs, chunks):
            batch = build_decode_batch(reqs, self.kv_pool, self.req_pool)
            # what an EXTEND batch would carry: tensor parallelism sends the cached prefixes' slots
            batch.host.prefix_parts = [(req.slots, req.num_cached) for req in reqs if req.num_cached]
        else:
            batch = build_extend_batch(reqs, chunks, self.kv_pool, self.req_pool)
        batch = self._prepare(batch, reqs)
        for req, n in zip(reqs, chunks):
            req.num_cached += n
        if self.spec_worker is not None:  # EAGLE keeps the target's hidden states of the prompt
            return self.spec_worker.forward_prefill(batch, reqs, chunks).logits
        return self.runner.forward(batch).logits

    def prefill_runs_as_decode(self, reqs: list[Req], chunks: list[int]) -> bool:
        """Whether the prefill of `chunks[i]` new tokens of each of `reqs` runs as a DECODE batch.

        When every request computes exactly one new token, its one query (position num_cached)
        attends to all of the request's cached tokens and its K/V goes to its new slot: that is a
        decode step, so it takes the decode graph of its batch size (split-KV decode kernels)
        instead of an extend graph's token bucket, for the same logits (under tensor parallelism
        the batch carries its cached prefixes' slots, as an EXTEND one does, for the workers' rows).
        It stays EXTEND where the decode form would not be the same forward: a speculative
        algorithm that reads the prefill (`_plain_prefill`; EAGLE keeps the target's hidden states
        of every prefilled token for its draft).
        The scheduler never sets a custom mask or logits rows on a prefill, has no prompt
        logprobs and no embedding inputs, and LoRA describes a decode batch as it does an extend
        one (a one-token segment per request), so none of these keeps EXTEND.
        """
        if any(n != 1 for n in chunks):
            return False
        return self.spec_worker is None or _plain_prefill(self.spec_worker)

    def sample_prefilled(self, reqs: list[Req], logits: torch.Tensor) -> LaunchedStep | None:
        """Sample the requests whose whole prompt (and output so far) is now cached; None if none is."""
        completes = [req.num_cached == req.num_tokens for req in reqs]
        done = [req for req, c in zip(reqs, completes) if c]
        if not done:
            return None
        if len(done) < len(reqs):
            rows = torch.tensor([i for i, c in enumerate(completes) if c]).to(logits.device, non_blocking=True)
            logits = logits.index_select(0, rows)
        tokens, logprobs = sample(logits, self.sampling.get(done, logits.device), self.generator, self.greedy_sample)
        # NOTE: the requests' earlier tokens are all read (none is in flight before a prefill), so
        # next_token_is_last is exact here: when it holds for all, no later step reads these tokens.
        return self._launch(done, tokens, logprobs, read_later=not all(r.next_token_is_last for r in done))

    def decode(self, reqs: list[Req]) -> LaunchedStep:
        """One decode step of `reqs`: a token each (several accepted drafts under speculation)."""
        if self.spec_worker is not None:
            return self._decode_speculative(reqs)
        batch = self._prepare(self.decode_state.build(reqs), reqs)
        for req in reqs:
            req.num_cached += 1
        logits = self.runner.forward(batch).logits
        tokens, logprobs = sample(logits, self.sampling.get(reqs, logits.device), self.generator, self.greedy_sample)
        self.decode_state.commit(reqs, tokens)
        return self._launch(reqs, tokens, logprobs)

    def _decode_speculative(self, reqs: list[Req]) -> LaunchedStep:
        """A speculative step; a request whose drafts would pass the context end decodes one
        token plainly instead (its greedy tokens are the same, so output is unchanged)."""
        fits = [r for r in reqs if self.spec_worker.fits_context(r)]
        near_end = [r for r in reqs if not self.spec_worker.fits_context(r)]
        new = self.spec_worker.decode(fits) if fits else []
        if near_end:
            batch = self._prepare(build_decode_batch(near_end, self.kv_pool, self.req_pool), near_end)
            for req in near_end:
                req.num_cached += 1
            tokens, logprobs = self.sample(near_end, self.runner.forward(batch).logits)
            new += [([t], [lp]) for t, lp in zip(tokens, logprobs)]
        return LaunchedStep.known_tokens(fits + near_end, new)

    def sample(self, reqs: list[Req], logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """Next token and its log-probability for each request, from logits [len(reqs), vocab]."""
        tokens, logprobs = sample(logits, self.sampling.get(reqs, logits.device), self.generator, self.greedy_sample)
        return tokens.tolist(), logprobs.tolist()

    def _prepare(self, batch: ForwardBatch, reqs: list[Req]) -> ForwardBatch:
        for p in self.participants:
            p.prepare_batch(batch, reqs)
        return batch

    def _launch(self, reqs: list[Req], tokens: torch.Tensor, logprobs: torch.Tensor,
                read_later: bool = True) -> LaunchedStep:
        """Start the copy of sampled tokens [len(reqs)] to the host; under overlap keep them on the
        device too, for the next step's inputs, unless `read_later` is False (each request's last token)."""
        if self.future is not None and read_later:
            self.future.store(reqs, tokens)
        return LaunchedStep.launch(reqs, tokens, logprobs)


def _plain_prefill(spec_worker: Any) -> bool:
    """Whether a speculative worker's prefill is the target's forward alone: it asks for no hidden
    states and keeps nothing of the prefill (SpecWorker's own `forward_prefill` and `after_prefill`,
    as ngram has). EAGLE overrides `after_prefill` to keep the target's hidden states."""
    cls = type(spec_worker)
    return (isinstance(spec_worker, SpecWorker) and not spec_worker.capture_hidden
            and cls.forward_prefill is SpecWorker.forward_prefill and cls.after_prefill is SpecWorker.after_prefill)
