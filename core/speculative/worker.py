"""The SpecWorker contract: draft a tree, verify it with the target, keep what greedy decoding keeps.

The scheduler calls `decode(reqs)` instead of its plain decode step, and `forward_prefill` for
prefill batches. One step:
  1. allocate `num_draft_tokens` KV slots per request (positions num_cached ..),
  2. `draft(views)` -> a DraftTree of num_draft_tokens nodes per request (node 0: the last token),
  3. verify: one TARGET_VERIFY forward of every node under the tree mask at positions
     num_cached + depth, then greedy acceptance (backplane.speculative.accept); the batch
     participants (LoRA) bind their per-batch state first, so each request's nodes run under its
     own adapter,
  4. keep the accepted nodes' slots in position order, free the rest, advance num_cached,
  5. `after_verify(views, ...)` lets the algorithm update its per-request state.
An algorithm implements `draft` and, when it keeps state, `after_prefill` / `after_verify`; they
receive SpecRequest views (backplane.speculative.request), never the engine's request objects.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from backplane.speculative.accept import Accepted, verify_greedy
from backplane.speculative.context import SpecContext
from backplane.speculative.kv import alloc_verify_slots, commit_accepted
from backplane.speculative.request import RequestAcceptance, RequestStore, SpecRequest, engine_requests
from backplane.speculative.stats import SpecStats
from backplane.speculative.tree import DraftTree, verify_mask
from backplane.speculative.verify_batch import build_verify_batch


class SpecWorker(ABC):
    """Base of every speculative algorithm; subclasses implement `draft`.

    runner: the target (TargetRunner); num_draft_tokens: tree nodes per request and step;
    stats: acceptance over the run (SpecStats); acceptance(req): one request's (RequestAcceptance).
    """

    capture_hidden = False  # does the algorithm need the target's hidden states (EAGLE)?
    # Can a request start at a cached prefix (KV computed for another request)? None if so, else
    # why not: the engine then turns the prefix cache off and says so.
    prefix_cache_refusal: str | None = None

    def __init__(self, ctx: SpecContext):
        self.ctx = ctx
        self.runner = ctx.runner
        self.num_draft_tokens = ctx.num_draft_tokens
        self.stats = SpecStats()
        self.request_store = RequestStore()  # each request's state and acceptance
        # Verify writes num_draft_tokens positions from num_cached: they must fit in a request row.
        room = self.runner.req_to_token_pool.max_context_len - min(self.runner.context_len,
                                                                   self.runner.token_to_kv_pool.num_slots)
        if self.num_draft_tokens - 1 > room:
            raise ValueError(f"--speculative-num-draft-tokens {self.num_draft_tokens}: expected at most {room + 1} "
                             f"(request rows hold {room} positions past the context length)")

    @property
    def positions_ahead(self) -> int:
        """How far past the root (position num_cached) one step reads or writes positions: the
        deepest draft node of a chain. An algorithm that drafts further overrides it."""
        return self.num_draft_tokens - 1

    def fits_context(self, req) -> bool:
        """Whether a speculative step of `req` stays inside the context (positions < context_len);
        the scheduler decodes one that does not plainly, one token per step."""
        return req.num_cached + self.positions_ahead < self.runner.context_len

    @property
    def slots_per_request(self) -> int:
        """KV slots one decode step of one request needs."""
        return self.num_draft_tokens

    def acceptance(self, req) -> RequestAcceptance | None:
        """The speculative steps of one request (the engine's request or its SpecRequest) so far,
        None before its first; kept as long as the request object lives."""
        found = self.request_store.peek(engine_requests([req])[0])
        return found.acceptance if found is not None else None

    def views(self, reqs: list) -> list[SpecRequest]:
        """The SpecRequest of each of the engine's requests `reqs`."""
        return [SpecRequest(r, self.request_store) for r in reqs]

    # -- what an algorithm implements -----------------------------------------------------------

    @abstractmethod
    def draft(self, reqs: list[SpecRequest]) -> DraftTree:
        """Propose num_draft_tokens nodes per request; node 0 is the root, `req.last_token`, at
        position `req.num_cached`. The verify slots of positions num_cached .. are allocated."""

    def after_prefill(self, reqs: list[SpecRequest], chunks: list[int], output) -> None:
        """After a prefill batch of the target: request i extended by chunks[i] tokens (its
        num_cached already counts them); output: the target's ModelOutput, with the final hidden
        states of every token when `capture_hidden`."""

    def after_verify(self, reqs: list[SpecRequest], tree: DraftTree, accepted: list[Accepted], output) -> None:
        """Called after the accepted slots are committed (num_cached already advanced); output:
        the verify forward's ModelOutput (hidden states of every node when `capture_hidden`)."""

    def init_cuda_graphs(self) -> None:
        """Capture the algorithm's own graphs (after the target's: `runner.graph_batch_sizes`)."""

    # -- what the scheduler calls ---------------------------------------------------------------

    def forward_prefill(self, batch, reqs: list, chunks: list[int]):
        """Run a prefill (extend) batch of the target for the engine's `reqs`, then `after_prefill`."""
        self.request_store.prune()
        output = self.runner.forward(batch, capture_hidden=self.capture_hidden)
        self.after_prefill(self.views(reqs), chunks, output)
        return output

    def decode(self, reqs: list) -> list[tuple[list[int], list[float]]]:
        """One speculative step for the engine's `reqs`; per request (new tokens, their log-probabilities)."""
        assert all(r.params.is_greedy for r in reqs), "speculative decoding here is greedy only"
        self.request_store.prune()
        runner, views = self.runner, self.views(reqs)
        alloc_verify_slots(reqs, self.num_draft_tokens, runner.token_to_kv_pool, runner.req_to_token_pool)
        tree = self.draft(views)
        accepted, logprobs, output = self.verify(reqs, tree)
        self.after_verify(views, tree, accepted, output)
        return [(a.new_tokens, [lp[n] for n in a.path]) for a, lp in zip(accepted, logprobs)]

    def verify(self, reqs: list, tree: DraftTree) -> tuple[list[Accepted], list[list[float]], Any]:
        """Run the target over the tree, accept greedily and commit the KV slots (the core's part
        of a step: `reqs` are the engine's requests)."""
        bs, n = tree.batch_size, tree.num_nodes
        prefix = [r.num_cached for r in reqs]
        mask, indptr = verify_mask(tree, prefix)
        positions = (torch.tensor(prefix)[:, None] + tree.depths).view(-1)
        on_device = tree.tokens is None  # the draft's tokens go to the target without a round trip
        input_ids = tree.device_tokens.view(-1) if on_device else tree.tokens.view(-1).tolist()
        batch = build_verify_batch(reqs, input_ids, positions.tolist(),
                                   torch.cat([r.slots[-1] for r in reqs]), n, mask, indptr,
                                   self.runner.req_to_token_pool, self.runner.token_to_kv_pool)
        self.ctx.prepare_target(batch, reqs)  # LoRA: one segment of n nodes per request, its adapter
        output = self.runner.forward(batch, capture_hidden=self.capture_hidden)
        logits = output.logits.view(bs, n, -1)  # [bs, nodes, vocab]
        best, choice = logits.max(-1)  # the target's greedy token after each node
        logprobs = best - torch.logsumexp(logits, -1)  # its log-probability, no [.., vocab] log-softmax
        # One device-to-host copy for all (token ids are exact in float64).
        rows = [choice, logprobs] + ([tree.device_tokens] if on_device else [])
        host = torch.stack([t.to(torch.float64) for t in rows]).cpu()
        choice, logprobs = host[0], host[1]
        if on_device:
            tree.tokens = host[2].to(torch.int64)
        accepted = verify_greedy(tree, choice.to(torch.int64))
        commit_accepted(reqs, [a.path for a in accepted], self.runner.token_to_kv_pool,
                        self.runner.req_to_token_pool)
        self._count(reqs, accepted)
        return accepted, logprobs.tolist(), output

    def _count(self, reqs: list, accepted: list[Accepted]) -> None:
        self.stats.add(accepted)
        for req, a in zip(reqs, accepted):
            counts = self.request_store.entry(req).acceptance
            counts.steps += 1
            counts.accepted_drafts += a.num_accepted_drafts
            counts.tokens += len(a.new_tokens)
