"""Continuous batching: a waiting queue, a running set, prefill batches then decode batches.

Each step chooses a batch, launches it (launcher.py), then reads the tokens of the step before
(overlap.py). Prefill comes first: running requests mid-prompt, then waiting ones that fit a free row
and the KV room left (admission.py; long prompts go in chunks of --chunked-prefill-size, each from its
longest cached prefix). Else decode: when KV slots run out, unreferenced prefix-cache entries are
evicted (least recently used first), then the newest running request is preempted (queues.py) and
later recomputed. A request that can never fit is aborted at once; a failed forward is rolled back.
A request whose token in flight is certainly its last (max_new_tokens) gives its KV back while the
device computes that token (`_finish_ahead`), so reading it is the last thing its request waits for.
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import Any, Callable, Sequence

import torch

from backplane.config import SchedulerConfig
from backplane.contracts.protocols import SchedulerParticipant
from backplane.scheduler.admission import admit_prefill, mid_prompt, ready_for_decode, refusal
from backplane.scheduler.launcher import BatchLauncher
from backplane.scheduler.overlap import FutureTokens, LaunchedStep, OneEach
from backplane.scheduler.prefix_cache import PrefixCache
from backplane.scheduler.queues import RequestQueues
from backplane.scheduler.request import Req
from backplane.scheduler.stopping import append_token, append_tokens

logger = logging.getLogger(__name__)


def _part(part: str, name: str, doc: str) -> property:
    """An attribute one of the scheduler's parts owns, read and set through the scheduler."""
    return property(lambda self: getattr(getattr(self, part), name),
                    lambda self, value: setattr(getattr(self, part), name, value), doc=f"{doc} (`{part}.{name}`)")


class Scheduler:
    """Continuous batching over one model runner's pools (see the module docstring).

    config: the resolved settings (backplane.config.SchedulerConfig). eos_token_ids and detokenize
    stop requests. participants (the LoRA manager) may refuse to admit a request next to the
    running ones (`can_admit(req, running)`) and describe every batch before it runs
    (`prepare_batch(batch, reqs)`). A speculative-decoding worker replaces the plain decode step.
    prefix_cache: shared prefixes' KV (a radix tree over the pool); by default nothing is cached.

    Its parts: `queues` (queues.py: waiting and running requests, release, preemption, rollback) and
    `launcher` (launcher.py: forward and sample); the step loop is here.
    """

    waiting = _part("queues", "waiting", "queued requests, in admission order")
    running = _part("queues", "running", "requests that hold a request row")
    isolated = _part("queues", "isolated", "ids of the requests that run alone since a failed forward")
    prefix_cache = _part("queues", "prefix_cache", "the prefix cache over the KV pool")
    participants = _part("launcher", "participants", "the SchedulerParticipants")
    spec_worker = _part("launcher", "spec_worker", "the speculative-decoding worker, or None")
    decode_state = _part("launcher", "decode_state", "the plain decode batch kept across steps")

    def __init__(self, runner, config: SchedulerConfig | int | None = None, *, eos_token_ids: set[int],
                 detokenize: Callable[[list[int]], str], participants: list[SchedulerParticipant] | None = None,
                 spec_worker: Any = None, prefix_cache: PrefixCache | None = None, **legacy: Any):
        self.config = config = _config(config, legacy)
        self.runner = runner
        self.req_pool = runner.req_to_token_pool
        self.kv_pool = runner.token_to_kv_pool
        self.max_running = min(config.max_running, self.req_pool.size - 1)
        self.chunk_size = config.chunk_size
        self.eos_token_ids = eos_token_ids
        self.detokenize = detokenize
        # Overlap (overlap.py): a step launches its batch, then reads the tokens of the step before
        # (`pending`), which ran on the device meanwhile. Speculative decoding reads its tokens at once.
        self.overlap = config.overlap and spec_worker is None
        self.future = FutureTokens(self.max_running, runner.device) if self.overlap else None
        self.shared_generator = torch.Generator(runner.device).manual_seed(config.seed)
        prefix_cache = prefix_cache or PrefixCache(self.kv_pool, self.req_pool, enabled=False)
        self.queues = RequestQueues(self.req_pool, prefix_cache, self.future)
        self.launcher = BatchLauncher(runner, participants or [], spec_worker=spec_worker, future=self.future,
                                      generator=self.shared_generator)
        self.current: list[Req] = []  # the batch being run, rolled back if its forward fails
        self.pending: LaunchedStep | None = None  # launched, tokens not read yet (overlap only)
        self._flushed: list[Req] = []  # finished while reading `pending` early, for a preemption
        # Requests finished ahead of their last token's read (`_finish_ahead`): rid -> request.
        self._ahead: dict[int, Req] = {}

    # -- requests -------------------------------------------------------------------------------

    def add(self, req: Req) -> None:
        """Queue a request, or abort it at once if it can never run."""
        error = self.refusal(req)
        if error:
            req.abort(error)
            return
        if req.params.seed is not None:
            req.generator = torch.Generator(self.runner.device).manual_seed(req.params.seed)
        self.waiting.append(req)

    def refusal(self, req: Req) -> str | None:
        """Why `req` can never run here (empty, too long, outside the vocabulary), or None."""
        vocab = getattr(getattr(self.runner, "hf_config", None), "vocab_size", None)
        return refusal(req, context_len=self.runner.context_len, num_kv_slots=self.kv_pool.num_slots,
                       spare_slots=self.decode_slots_per_request - 1, vocab_size=vocab)

    def abort(self, req: Req, message: str) -> None:
        """Abort one queued or running request and return its KV slots and row at once."""
        self.queues.abort(req, message)

    def abort_all(self, message: str) -> list[Req]:
        """Abort every queued and running request (after an unrecoverable forward error), and those
        finished ahead of a token that will not be read."""
        return self._abort_ahead(message) + self.queues.abort_all(message)

    @property
    def kv_usage(self) -> tuple[int, int]:
        """(KV slots requests hold, slots in the pool); prefix-cache entries no request references
        count as free (eviction hands them out on demand)."""
        return self.kv_pool.num_slots - self.prefix_cache.available(), self.kv_pool.num_slots

    @property
    def has_work(self) -> bool:
        queues = self.queues  # NOTE: not through the properties: read every step
        return bool(queues.waiting or queues.running or self.pending is not None)

    @property
    def decode_slots_per_request(self) -> int:
        """KV slots one decode step needs per request (all the draft tokens under speculation)."""
        return self.spec_worker.slots_per_request if self.spec_worker is not None else 1

    def sample(self, reqs: list[Req], logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """Next token and its log-probability for each request, from logits [len(reqs), vocab]."""
        return self.launcher.sample(reqs, logits)

    # -- one step -------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[Req]:
        """One step: build and launch the next batch, then read the tokens of the previous step and
        return the requests that finished.

        Under inference mode, as the forward already is: the batch's and the sampler's tensor
        operations skip autograd's dispatch (each a little host time, paid before the graph launch).

        Without overlap the previous step is the one just launched (its tokens are read at once);
        with it, the step launched here runs on the device while the host reads the one before.
        """
        launched = self.launch_step()
        if launched is not None:
            self._finish_ahead(launched.reqs)
        to_read = launched
        if self.overlap:
            to_read, self.pending = self.pending, launched
        finished = self.finish_step(to_read)
        flushed, self._flushed = self._flushed, []
        return flushed + finished

    @torch.inference_mode()
    def flush(self) -> list[Req]:
        """Read the step in flight, if any: the host state is exact afterwards."""
        pending, self.pending = self.pending, None
        return self.finish_step(pending)

    def launch_step(self) -> LaunchedStep | None:
        """Schedule and launch one batch; None when nothing ran or nothing was sampled."""
        self.current = []
        prefilling = mid_prompt(self.queues.running)  # NOTE: once per step, for admission and decode
        prefill = admit_prefill(self.queues, self.participants, token_budget=self.chunk_size, max_running=self.max_running,
                                decode_slots_per_request=self.decode_slots_per_request, prefilling=prefilling)
        if prefill:
            self.current = prefill[0]
            return self._run_prefill(*prefill)
        self.current = self._schedule_decode(prefilling)
        return self._run_decode(self.current) if self.current else None

    def _run_prefill(self, reqs: list[Req], chunks: list[int]) -> LaunchedStep | None:
        """Forward a prefill batch, cache its new KV, and sample the requests whose prompt is done."""
        logits = self.launcher.forward_prefill(reqs, chunks)
        for req, n in zip(reqs, chunks):
            self.prefix_cache.cache_prefilled(req, n)
        return self.launcher.sample_prefilled(reqs, logits)

    def _run_decode(self, reqs: list[Req]) -> LaunchedStep:
        """One decode step (tests/gpu/test_overlap_gpu.py wraps it: it must never synchronize)."""
        return self.launcher.decode(reqs)

    def _schedule_decode(self, prefilling: list[Req] | None = None) -> list[Req]:
        """The running requests that decode this step, preempting the newest while KV is short.

        prefilling: the running requests mid-prompt (`mid_prompt`), when the caller has them."""
        ready = ready_for_decode(self.running, self.pending, prefilling)
        if not ready:
            return []
        need = self.decode_slots_per_request * len(ready)
        if self.pending is not None and self.prefix_cache.available() < need:
            # NOTE: preemption needs exact host state (no token in flight): finish the last step first.
            self._flushed += self.flush()
            ready = ready_for_decode(self.running, self.pending)
        while ready and self.prefix_cache.available() < self.decode_slots_per_request * len(ready):
            victim = ready.pop()  # newest first
            logger.info("preempting request %d (KV pool full); it will be recomputed", victim.rid)
            self.queues.preempt(victim, keep=True)
        self.prefix_cache.make_room(self.decode_slots_per_request * len(ready))
        isolated = self.isolated
        if not isolated:
            return ready
        alone = [r for r in ready if r.rid in isolated]
        return alone[:1] or ready

    def _finish_ahead(self, reqs: list[Req]) -> None:
        """Hand the KV and row of each request whose token in flight is certainly its last back now,
        while the device computes that token, instead of after it is read.

        A request qualifies when the token reaches max_new_tokens whatever its value (it stops there,
        on that token or earlier one way or another) and every token before it is on the host (its
        KV is all in this step or earlier ones): it needs nothing more from the pool, and what the
        prefix cache keeps of it (its KV-bearing tokens) is already known. The slots and the row go
        back while this step still writes them; whatever later uses them runs after it on the
        device's stream, as any release under overlap. Under speculation a step's tokens are read
        at launch (nothing to hide) and may leave KV past a stop token: never there.
        For a one-token request (a prompt's score, a classification) the first token is then read
        with nothing left to do but the output.
        """
        if self.spec_worker is not None:
            return
        for req in reqs:  # NOTE: the rarest condition first: it is tested for every request every step
            if req.next_token_is_last and req.row is not None and not req.finished and req.num_tokens == req.num_cached:
                self.queues.finish(req)
                self._ahead[req.rid] = req

    # -- reading a launched step ----------------------------------------------------------------

    def finish_step(self, step: LaunchedStep | None) -> list[Req]:
        """Read a launched step's tokens (waiting for them) and advance its requests."""
        return self._advance(step.reqs, step.new_tokens()) if step is not None else []

    def _advance(self, reqs: list[Req], new: Sequence[tuple[list[int], list[float]]]) -> list[Req]:
        """Append each request's new tokens (one, or several accepted drafts) until it stops.

        A request that stopped (or was aborted) after this step was launched keeps none of them. A
        request finished ahead (`_finish_ahead`) has no row any more: it takes its token and stops
        (its token is its last).
        """
        # NOTE: a plain decode step (OneEach) is read from its flat lists, one token per request:
        # no pair of lists per request, one call each (`append_token`).
        one_each = isinstance(new, OneEach)
        pairs, append = (zip(new.tokens, new.logprobs), append_token) if one_each else (new, append_tokens)
        finished = []
        now = time.perf_counter()
        ahead_map, eos, detokenize = self._ahead, self.eos_token_ids, self.detokenize
        for req, (tokens, logprobs) in zip(reqs, pairs):
            ahead = bool(ahead_map) and ahead_map.pop(req.rid, None) is not None
            if req.finish_reason is not None or (req.row is None and not ahead):
                continue
            if req.first_token_at is None and (one_each or tokens):
                req.first_token_at = now
            if append(req, tokens, logprobs, eos, detokenize) or ahead:
                req.finished_at = now
                if not ahead:
                    self.queues.finish(req)
                finished.append(req)
        return finished

    def fail_batch(self, message: str) -> list[Req]:
        """After the forward of the current batch raised: roll it back; return the requests aborted.

        A lone request is aborted with `message`; several are preempted and run alone from then on
        (`RequestQueues.roll_back`). Requests outside the batch are untouched; without a batch (a
        failure while scheduling) every request is aborted.
        """
        if self.pending is not None:
            try:  # the step before the failed one still holds tokens of requests outside it
                self._flushed += self.flush()
            except Exception:  # noqa: BLE001 - its tokens are lost: nothing can be kept
                self._flushed = []
                return self.abort_all(message)
        kept, self._flushed = self._flushed, []
        batch, self.current = self.current, []
        return kept + self._abort_ahead(message) + self.queues.roll_back(batch, message)

    def _abort_ahead(self, message: str) -> list[Req]:
        """The requests finished ahead whose last token will never be read (its step failed), aborted
        (their KV and row went back already)."""
        lost = [req for req in self._ahead.values() if not req.finished]
        self._ahead.clear()
        for req in lost:
            req.abort(message)
        return lost


def _config(config: SchedulerConfig | int | None, legacy: dict[str, Any]) -> SchedulerConfig:
    """The SchedulerConfig, from the deprecated keywords (max_running=, chunk_size=, seed=, overlap=)
    when it is not given as one."""
    if isinstance(config, SchedulerConfig) and not legacy:
        return config
    if isinstance(config, int):
        legacy["max_running"] = config
    unknown = set(legacy) - {"max_running", "chunk_size", "seed", "overlap"}
    if unknown or "max_running" not in legacy or "chunk_size" not in legacy:
        raise TypeError(f"Scheduler: expected a SchedulerConfig (backplane.config), got {config!r} and keywords "
                        f"{sorted(legacy)}; valid keywords: max_running, chunk_size, seed, overlap")
    warnings.warn("Scheduler(runner, max_running=..., chunk_size=...) is deprecated since backplane 0.2; pass "
                  "Scheduler(runner, SchedulerConfig(...)) (backplane.config)", DeprecationWarning, stacklevel=3)
    return SchedulerConfig(**legacy)
