"""Turning scheduled requests into a ForwardBatch (host lists -> device tensors in one go)."""

from __future__ import annotations

import torch

from backplane.executor.batch import ForwardBatch, ForwardMode
from backplane.engine.overlap import FutureTokens
from backplane.engine.request import Req
from backplane.executor.memory import ReqToTokenPool, TokenToKVPool


def _assign_slots(reqs: list[Req], counts: list[int], kv_pool: TokenToKVPool,
                  req_pool: ReqToTokenPool) -> torch.Tensor:
    """Allocate counts[i] new KV slots for reqs[i] and record them in req_to_token; returns them (host)."""
    slots = kv_pool.alloc(sum(counts))
    rows, positions = [], []
    start = 0
    for req, n in zip(reqs, counts):
        req.slots.append(slots[start:start + n])
        rows += [req.row] * n
        positions += range(req.num_cached, req.num_cached + n)
        start += n
    device = req_pool.req_to_token.device
    req_pool.req_to_token[torch.tensor(rows, device=device), torch.tensor(positions, device=device)] = (
        slots.to(device, torch.int32))
    return slots


def build_extend_batch(reqs: list[Req], chunks: list[int], kv_pool: TokenToKVPool,
                       req_pool: ReqToTokenPool, mode: ForwardMode = ForwardMode.EXTEND) -> ForwardBatch:
    """reqs[i] computes `chunks[i]` new tokens after its `num_cached` cached ones."""
    out_cache_loc = _assign_slots(reqs, chunks, kv_pool, req_pool)
    input_ids, positions = [], []
    for req, n in zip(reqs, chunks):
        input_ids += req.ids_between(req.num_cached, req.num_cached + n)
        positions += range(req.num_cached, req.num_cached + n)
    prefix = [req.num_cached for req in reqs]
    seq_lens = [p + n for p, n in zip(prefix, chunks)]
    return _make_batch(mode, reqs, input_ids, positions, seq_lens, out_cache_loc, req_pool, kv_pool,
                       prefix=prefix, extend=chunks)


def build_decode_batch(reqs: list[Req], kv_pool: TokenToKVPool, req_pool: ReqToTokenPool,
                       future: FutureTokens | None = None) -> ForwardBatch:
    """One new token per request: the last generated one, at position `num_cached`.

    A token still in flight (overlap scheduling) goes in as its negative placeholder from
    `future`; the caller resolves `input_ids` on the device before the forward.
    """
    out_cache_loc = _assign_slots(reqs, [1] * len(reqs), kv_pool, req_pool)
    input_ids = [_last_token(req, future) for req in reqs]
    positions = [req.num_cached for req in reqs]
    seq_lens = [p + 1 for p in positions]
    return _make_batch(ForwardMode.DECODE, reqs, input_ids, positions, seq_lens, out_cache_loc,
                       req_pool, kv_pool)


def _last_token(req: Req, future: FutureTokens | None) -> int:
    if req.num_cached < req.num_tokens:
        return req.token_at(req.num_cached)
    assert future is not None, f"request {req.rid}: no token at position {req.num_cached} and no future map"
    return future.placeholder(req)


def _make_batch(mode, reqs, input_ids, positions, seq_lens, out_cache_loc, req_pool, kv_pool,
                prefix=None, extend=None) -> ForwardBatch:
    device = req_pool.req_to_token.device

    def dev(values, dtype=torch.int64):
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int32)
    batch = ForwardBatch(
        forward_mode=mode, batch_size=len(reqs), input_ids=dev(input_ids), positions=dev(positions),
        req_pool_indices=dev([req.row for req in reqs]), seq_lens=seq_lens_cpu.to(device),
        seq_lens_cpu=seq_lens_cpu, out_cache_loc=out_cache_loc.to(device),
        req_to_token_pool=req_pool, token_to_kv_pool=kv_pool,
    )
    if extend is not None:
        batch.set_extend_lens(prefix, extend)
    return batch
