"""DecodeState: the decode batch kept across steps, advanced in place while its requests stay.

In the steady state a decode step runs the same requests, in the same order, as the one before;
then nothing is rebuilt from host lists (vLLM's persistent batch, SGLang's overlap scheduler):

- positions, seq_lens (device) and seq_lens_cpu (host) advance by one in place;
- the request rows (req_pool_indices) are unchanged;
- the input ids are the tokens the previous step sampled, still on the device (under overlap the
  same values the future-token ring holds), so no placeholder is built or resolved;
- only the new KV slots go over, in one non-blocking copy of the allocator's host tensor, and are
  recorded in req_to_token with one device index write.

When the requests change (one finished, one was admitted, preempted or re-prefilled under another
row) the batch is built once from host lists (`build_decode_batch`) and becomes the new state.
No step makes a blocking host-device copy: a blocking copy would synchronize the stream and put
the host back in series with the step in flight.
"""

from __future__ import annotations

from operator import attrgetter, is_

import torch

from backplane.scheduler.batch_builder import build_decode_batch
from backplane.scheduler.overlap import FutureTokens
from backplane.scheduler.request import Req
from backplane.contracts.batch import ForwardBatch, ForwardMode, HostBatch
from backplane.contracts.memory import ReqToTokenPool, TokenToKVPool

_ROW = attrgetter("row")
_NUM_CACHED = attrgetter("num_cached")


class DecodeState:
    """Builds plain decode batches, reusing the last one's tensors while its requests stay.

    Protocol, once per decode step: `build(reqs)` before the forward (the caller then adds one to
    each request's `num_cached`), `commit(reqs, tokens)` after sampling. A step that fails before
    `commit` leaves no state, so the next one rebuilds.

    reuse=False always builds from host lists: the reference path tests and bench/host_step.py
    compare against.

    NOTE: a batch's positions, seq_lens, seq_lens_cpu, out_cache_loc and req_pool_indices are the
    state's buffers, rewritten in place by the next step that reuses them (on the device in stream
    order, so kernels of the step in flight read their own values). A consumer that keeps a batch
    past the next `build` on the host must copy them.
    """

    def __init__(self, kv_pool: TokenToKVPool, req_pool: ReqToTokenPool, future: FutureTokens | None = None,
                 reuse: bool = True):
        self.kv_pool = kv_pool
        self.req_pool = req_pool
        self.future = future
        self.reuse = reuse
        self.num_rebuilt = 0  # steps built from host lists
        self.num_reused = 0  # steps that advanced the previous batch in place
        self._clear()

    def _clear(self) -> None:
        self._batch: ForwardBatch | None = None
        self._reqs: list[Req] = []
        self._rows: list[int | None] = []
        self._num_cached: list[int] = []
        self._tokens: torch.Tensor | None = None

    def build(self, reqs: list[Req]) -> ForwardBatch:
        """The decode batch of `reqs` (one new token each, input ids resolved on the device).

        Allocates one KV slot per request (appended to `req.slots`) and records it in
        req_to_token, exactly as `build_decode_batch` does.
        """
        if self.reuse and self._unchanged(reqs):
            batch = self._advance()
            self.num_reused += 1
        else:
            batch = self._rebuild(reqs)
            self.num_rebuilt += 1
        self._batch, self._tokens = batch, None  # valid again once commit() has the sampled tokens
        return batch

    def commit(self, reqs: list[Req], tokens: torch.Tensor) -> None:
        """After the forward of `build(reqs)`: tokens [len(reqs)] int64 on the device, sampled by it.

        The requests' `num_cached` must already count this step's token.
        """
        assert self._batch is not None and tokens.shape[0] == self._batch.batch_size, (
            f"DecodeState.commit: expected {0 if self._batch is None else self._batch.batch_size} "
            f"tokens of the built batch, got {tokens.shape[0]}")
        self._num_cached = list(map(_NUM_CACHED, reqs))
        self._tokens = tokens

    def _unchanged(self, reqs: list[Req]) -> bool:
        """Same request objects in the same order, in the same rows, each one token further on:
        then every request's next input is the token the last step sampled for it."""
        return (self._tokens is not None and len(reqs) == len(self._reqs) and all(map(is_, reqs, self._reqs))
                and list(map(_ROW, reqs)) == self._rows and list(map(_NUM_CACHED, reqs)) == self._num_cached)

    def _rebuild(self, reqs: list[Req]) -> ForwardBatch:
        """Host lists -> one packed non-blocking copy (`build_decode_batch`); placeholders resolved."""
        self._clear()
        batch = build_decode_batch(reqs, self.kv_pool, self.req_pool, self.future)
        if self.future is not None:
            batch.input_ids = self.future.resolve(batch.input_ids)
        self._reqs, self._rows = list(reqs), list(map(_ROW, reqs))
        return batch

    def _advance(self) -> ForwardBatch:
        """The previous batch one token further on, its tensors updated in place."""
        prev, reqs = self._batch, self._reqs
        slots = self.kv_pool.alloc(len(reqs))  # [bs] int64, host
        for req, slot in zip(reqs, slots.view(-1, 1).unbind()):  # [1] views, as build_decode_batch appends
            req.slots.append(slot)
        # NOTE: the host copies first: on CPU the "device" tensors below are the host ones themselves.
        host = _advanced_host(prev.host, slots)
        loc = prev.out_cache_loc.copy_(slots, non_blocking=True)  # a pageable source: no stream sync
        positions = prev.positions.add_(1)
        prev.seq_lens.add_(1)
        prev.seq_lens_cpu.add_(1)
        self.req_pool.req_to_token[prev.req_pool_indices, positions] = loc.to(torch.int32)
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=prev.batch_size, input_ids=self._tokens,
            positions=positions, req_pool_indices=prev.req_pool_indices, seq_lens=prev.seq_lens,
            seq_lens_cpu=prev.seq_lens_cpu, out_cache_loc=loc,
            req_to_token_pool=self.req_pool, token_to_kv_pool=self.kv_pool, host=host,
        )


def _advanced_host(prev: HostBatch | None, slots: torch.Tensor) -> HostBatch | None:
    """The host copies of a reused step (tensor parallelism sends them): positions one further, the
    new slots, the same rows, and every input id marked in flight (-1): the ids are the last step's
    sampled tokens, on the device only, so the workers receive them by device broadcast."""
    if prev is None:
        return None
    return HostBatch(input_ids=torch.full_like(prev.req_pool_indices, -1), positions=prev.positions + 1,
                     out_cache_loc=slots, req_pool_indices=prev.req_pool_indices)
