"""Continuous batching: a waiting queue, a running set, prefill batches then decode batches.

Admission needs a free request row (at most --max-running-requests run at once) and enough free
KV slots for the prompt chunk plus one slot per running request. Prompts longer than
--chunked-prefill-size are prefilled in chunks over several steps. When decode runs out of KV
slots the newest running request is preempted: its slots are freed and it waits again, to be
recomputed later with its output so far. A request that could never fit (longer than the
context or the whole pool) is aborted with a clear error while the others go on.

With a prefix cache (backplane.scheduler.prefix_cache), waiting requests are admitted longest cached
prefix first, and admission starts a request at its longest cached prefix and prefills only the
rest; finished and preempted requests leave their KV in the cache, whose unreferenced entries are
evicted (least recently used first) before anything is preempted.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import deque
from typing import Any, Callable

import torch

from backplane.config import SchedulerConfig
from backplane.contracts.batch import ForwardBatch
from backplane.contracts.protocols import SchedulerParticipant
from backplane.scheduler.batch_builder import build_decode_batch, build_extend_batch
from backplane.scheduler.decode_state import DecodeState
from backplane.scheduler.overlap import FutureTokens, LaunchedStep
from backplane.scheduler.prefix_cache import PrefixCache
from backplane.scheduler.radix import RadixTree
from backplane.scheduler.request import Req
from backplane.scheduler.stopping import check_stop
from backplane.scheduler.sampling_state import SamplingCache
from backplane.layers.sampler import sample

logger = logging.getLogger(__name__)


class Scheduler:
    """Continuous batching over one model runner's pools (see the module docstring).

    config: the resolved settings (backplane.config.SchedulerConfig). eos_token_ids and detokenize
    stop requests. participants (the LoRA manager) may refuse to admit a request next to the
    running ones (`can_admit(req, running)`) and describe every batch before it runs
    (`prepare_batch(batch, reqs)`). A speculative-decoding worker replaces the plain decode step.
    prefix_cache: shared prefixes' KV (a radix tree over the pool); by default nothing is cached.
    """

    def __init__(self, runner, config: SchedulerConfig | int | None = None, *, eos_token_ids: set[int],
                 detokenize: Callable[[list[int]], str], participants: list[SchedulerParticipant] | None = None,
                 spec_worker: Any = None, prefix_cache: PrefixCache | None = None, **legacy: Any):
        config = _config(config, legacy)
        self.config = config
        self.runner = runner
        self.req_pool = runner.req_to_token_pool
        self.kv_pool = runner.token_to_kv_pool
        self.max_running = min(config.max_running, self.req_pool.size - 1)
        self.chunk_size = config.chunk_size
        self.eos_token_ids = eos_token_ids
        self.detokenize = detokenize
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.shared_generator = torch.Generator(runner.device).manual_seed(config.seed)
        self.participants = participants or []
        self.spec_worker = spec_worker
        self.prefix_cache = prefix_cache or PrefixCache(self.kv_pool, self.req_pool, enabled=False)
        # After a failed forward: the requests of the batch being run, and those that run alone.
        self.current: list[Req] = []
        self.isolated: set[int] = set()
        self.sampling = SamplingCache()
        # Overlap scheduling (backplane.scheduler.overlap): a step launches its batch, then reads the
        # tokens of the step before (`pending`), which ran on the device meanwhile. Speculative
        # decoding reads its tokens at once.
        self.overlap = config.overlap and spec_worker is None
        self.future = FutureTokens(self.max_running, runner.device) if self.overlap else None
        self.pending: LaunchedStep | None = None  # launched, tokens not read yet (overlap only)
        self._flushed: list[Req] = []  # finished while reading `pending` early, for a preemption
        # Plain decode batches: advanced in place while the same requests decode step after step.
        self.decode_state = DecodeState(self.kv_pool, self.req_pool, self.future)

    # -- requests -------------------------------------------------------------------------------

    def add(self, req: Req) -> None:
        """Queue a request, or abort it at once if it can never run."""
        error = self._never_fits(req)
        if error:
            req.abort(error)
            return
        if req.params.seed is not None:
            req.generator = torch.Generator(self.runner.device).manual_seed(req.params.seed)
        self.waiting.append(req)

    def refusal(self, req: Req) -> str | None:
        """Why `req` can never run here (empty, too long, outside the vocabulary), or None."""
        return self._never_fits(req)

    def _never_fits(self, req: Req) -> str | None:
        n, m = len(req.prompt_ids), req.params.max_new_tokens
        if n == 0:
            return f"request {req.rid}: empty prompt; expected at least one token"
        context = self.runner.context_len
        if n + m > context:
            return (f"request {req.rid}: prompt of {n} tokens + max_new_tokens {m} exceeds the context "
                    f"length {context}; shorten the prompt or lower max_new_tokens")
        # A speculative step holds slots for every draft token, beyond the request's last position.
        spare = self.decode_slots_per_request - 1
        if n + m + spare > self.kv_pool.num_slots:
            return (f"request {req.rid}: prompt of {n} tokens + max_new_tokens {m} needs {n + m + spare} KV slots "
                    f"but the pool holds {self.kv_pool.num_slots}; raise --max-total-tokens")
        vocab = getattr(getattr(self.runner, "hf_config", None), "vocab_size", None)
        ids = req.prompt_ids
        if vocab and not (min(ids) >= 0 and max(ids) < vocab):  # min/max first: they run at C speed
            bad = next(t for t in ids if not 0 <= t < vocab)
            return f"request {req.rid}: token id {bad} is outside the vocabulary; expected ids in [0, {vocab})"
        return None

    @property
    def kv_usage(self) -> tuple[int, int]:
        """(KV slots requests hold, slots in the pool); prefix-cache entries no request references
        count as free (eviction hands them out on demand)."""
        return self.kv_pool.num_slots - self.prefix_cache.available(), self.kv_pool.num_slots

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.pending is not None)

    # -- one step -------------------------------------------------------------------------------

    def step(self) -> list[Req]:
        """One step: build and launch the next batch, then read the tokens of the previous step and
        return the requests that finished.

        Without overlap the previous step is the one just launched (its tokens are read at once);
        with it, the step launched here runs on the device while the host reads the one before.
        """
        launched = self.launch_step()
        to_read = launched
        if self.overlap:
            to_read, self.pending = self.pending, launched
        finished = self.finish_step(to_read)
        flushed, self._flushed = self._flushed, []
        return flushed + finished

    def flush(self) -> list[Req]:
        """Read the step in flight, if any: the host state is exact afterwards."""
        pending, self.pending = self.pending, None
        return self.finish_step(pending)

    def launch_step(self) -> LaunchedStep | None:
        """Schedule and launch one batch; None when nothing ran or nothing was sampled."""
        self.current = []
        prefill = self._schedule_prefill()
        if prefill:
            self.current = prefill[0]
            return self._run_prefill(*prefill)
        self.current = self._schedule_decode()
        return self._run_decode(self.current) if self.current else None

    def _schedule_prefill(self) -> tuple[list[Req], list[int]] | None:
        reqs, chunks, budget = [], [], self.chunk_size
        reserve = self.decode_slots_per_request * sum(1 for r in self.running if not r.needs_prefill)
        cache, in_batch = self.prefix_cache, RadixTree()
        may_admit = len(self.running) < self.max_running
        candidates = [r for r in self.running if r.needs_prefill] + (
            cache.admission_order(self.waiting) if may_admit else list(self.waiting))
        for req in candidates:
            is_new = req.row is None
            if budget == 0 or (is_new and len(self.running) + sum(r.row is None for r in reqs) >= self.max_running):
                break
            if reqs and req.rid in self.isolated:
                break
            if is_new and not cache.match(req, in_batch):
                continue  # a request in this batch computes its prefix; it reads it from the cache next
            if not is_new:
                cache.computes_in_batch(req, in_batch)
            remaining = req.num_tokens - req.num_cached - (1 if req.output_ids else 0)
            n = min(remaining, budget)
            if n > cache.available() - reserve - sum(chunks) or (is_new and not self._admissible(req, reqs)):
                if is_new:
                    cache.unmatch(req)
                break
            reqs.append(req)
            chunks.append(n)
            budget -= n
            if req.rid in self.isolated:
                break
        if not reqs:
            return None
        cache.make_room(sum(chunks))
        for req in reqs:
            if req.row is None:
                self.waiting.remove(req)
                req.row = self.req_pool.alloc()
                cache.admit(req)
                self.running.append(req)
        return reqs, chunks

    def _admissible(self, req: Req, chosen: list[Req]) -> bool:
        batch_mates = self.running + [r for r in chosen if r.row is None]
        return all(p.can_admit(req, batch_mates) for p in self.participants)

    def _prepare(self, batch: ForwardBatch, reqs: list[Req]) -> ForwardBatch:
        for p in self.participants:
            p.prepare_batch(batch, reqs)
        return batch

    def _schedule_decode(self) -> list[Req]:
        ready = self._ready_for_decode()
        need = self.decode_slots_per_request * len(ready)
        if self.pending is not None and self.prefix_cache.available() < need:
            # NOTE: preemption needs exact host state (no token in flight): finish the last step first.
            self._flushed += self.flush()
            ready = self._ready_for_decode()
        while ready and self.prefix_cache.available() < self.decode_slots_per_request * len(ready):
            victim = ready.pop()  # newest first
            self._preempt(victim, keep=True)
        self.prefix_cache.make_room(self.decode_slots_per_request * len(ready))
        alone = [r for r in ready if r.rid in self.isolated]
        return alone[:1] or ready

    def _ready_for_decode(self) -> list[Req]:
        """Running requests that can decode. Under overlap, one whose token in flight is its last
        (max_new_tokens reached) is left out: it finishes when that step is read, and a step for it
        would only be thrown away."""
        ready = [r for r in self.running if not r.needs_prefill]
        if self.pending is None:
            return ready
        last = {id(r) for r in self.pending.reqs if len(r.output_ids) + 1 >= r.params.max_new_tokens}
        return [r for r in ready if id(r) not in last]

    @property
    def decode_slots_per_request(self) -> int:
        """KV slots one decode step needs per request (all the draft tokens under speculation)."""
        return self.spec_worker.slots_per_request if self.spec_worker is not None else 1

    def _preempt(self, req: Req, keep: bool = False) -> None:
        logger.info("preempting request %d (KV pool full); it will be recomputed", req.rid)
        self._release(req, keep)
        self.running.remove(req)
        self.waiting.appendleft(req)

    def _release(self, req: Req, keep: bool = False) -> None:
        """Free the request's KV and row; keep=True hands valid KV to the prefix cache (not after a
        failed forward, whose slots may be half written)."""
        self.prefix_cache.release(req, keep)
        req.slots, req.num_cached = [], 0
        if req.row is not None:
            self.req_pool.free(req.row)
            req.row = None
        if self.future is not None:
            self.future.forget(req)

    # -- running batches ------------------------------------------------------------------------

    def _run_prefill(self, reqs: list[Req], chunks: list[int]) -> LaunchedStep | None:
        batch = self._prepare(build_extend_batch(reqs, chunks, self.kv_pool, self.req_pool), reqs)
        completes = [req.num_cached + n == req.num_tokens for req, n in zip(reqs, chunks)]
        for req, n in zip(reqs, chunks):
            req.num_cached += n
        if self.spec_worker is not None:  # EAGLE keeps the target's hidden states of the prompt
            logits = self.spec_worker.forward_prefill(batch, reqs, chunks).logits
        else:
            logits = self.runner.forward(batch).logits
        for req, n in zip(reqs, chunks):
            self.prefix_cache.cache_prefilled(req, n)
        done = [req for req, c in zip(reqs, completes) if c]
        if not done:
            return None
        if len(done) < len(reqs):
            rows = torch.tensor([i for i, c in enumerate(completes) if c]).to(logits.device, non_blocking=True)
            logits = logits.index_select(0, rows)
        return self._sample_on_device(done, logits)

    def _run_decode(self, reqs: list[Req]) -> LaunchedStep:
        if self.spec_worker is not None:
            return self._run_speculative(reqs)
        batch = self._prepare(self.decode_state.build(reqs), reqs)
        for req in reqs:
            req.num_cached += 1
        logits = self.runner.forward(batch).logits
        tokens, logprobs = sample(logits, self.sampling.get(reqs, logits.device), self.shared_generator)
        self.decode_state.commit(reqs, tokens)
        return self._launch(reqs, tokens, logprobs)

    def _run_speculative(self, reqs: list[Req]) -> LaunchedStep:
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
        tokens, logprobs = sample(logits, self.sampling.get(reqs, logits.device), self.shared_generator)
        return tokens.tolist(), logprobs.tolist()

    def _sample_on_device(self, reqs: list[Req], logits: torch.Tensor) -> LaunchedStep:
        tokens, logprobs = sample(logits, self.sampling.get(reqs, logits.device), self.shared_generator)
        return self._launch(reqs, tokens, logprobs)

    def _launch(self, reqs: list[Req], tokens: torch.Tensor, logprobs: torch.Tensor) -> LaunchedStep:
        """Start the copy of sampled tokens [len(reqs)] to the host; under overlap keep them on the device too."""
        if self.future is not None:
            self.future.store(reqs, tokens)
        return LaunchedStep.launch(reqs, tokens, logprobs)

    def finish_step(self, step: LaunchedStep | None) -> list[Req]:
        """Read a launched step's tokens (waiting for them) and advance its requests."""
        return self._advance(step.reqs, step.new_tokens()) if step is not None else []

    def _advance(self, reqs: list[Req], new: list[tuple[list[int], list[float]]]) -> list[Req]:
        """Append each request's new tokens (one, or several accepted drafts) until it stops.

        A request that stopped (or was aborted) after this step was launched keeps none of them.
        """
        finished = []
        now = time.perf_counter()
        for req, (tokens, logprobs) in zip(reqs, new):
            if req.finished or req.row is None:
                continue
            if req.first_token_at is None and tokens:
                req.first_token_at = now
            for token, logprob in zip(tokens, logprobs):
                req.output_ids.append(token)
                req.logprobs.append(logprob)
                if check_stop(req, self.eos_token_ids, self.detokenize):
                    break
            if req.finished:
                req.finished_at = now
                self._release(req, keep=True)
                self.running.remove(req)
                self.isolated.discard(req.rid)
                finished.append(req)
        return finished

    def abort(self, req: Req, message: str) -> None:
        """Abort one queued or running request and return its KV slots and row at once."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        req.abort(message)

    def fail_batch(self, message: str) -> list[Req]:
        """After the forward of the current batch raised: roll it back; return the requests aborted.

        A lone request is aborted with `message`. Several are preempted (slots and rows freed, to
        be recomputed) and from then on each runs alone, so the next failure names the culprit.
        Requests outside the batch are untouched; without a batch (a failure while scheduling)
        every request is aborted.
        """
        if self.pending is not None:
            try:  # the step before the failed one still holds tokens of requests outside it
                self._flushed += self.flush()
            except Exception:  # noqa: BLE001 - its tokens are lost: nothing can be kept
                self._flushed = []
                return self.abort_all(message)
        kept, self._flushed = self._flushed, []
        return kept + self._roll_back(message)

    def _roll_back(self, message: str) -> list[Req]:
        batch = [r for r in self.current if any(r is s for s in self.running)]
        self.current = []
        if not batch:
            return self.abort_all(message)
        if len(batch) == 1:
            req = batch[0]
            self._release(req)
            self.running.remove(req)
            self.isolated.discard(req.rid)
            req.abort(message)
            return [req]
        for req in reversed(batch):
            self._preempt(req)
            self.isolated.add(req.rid)
        return []

    def abort_all(self, message: str) -> list[Req]:
        """Abort every queued and running request (after an unrecoverable forward error)."""
        reqs = list(self.running) + list(self.waiting)
        for req in reqs:
            self._release(req)
            req.abort(message)
        self.running.clear()
        self.waiting.clear()
        return reqs



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
