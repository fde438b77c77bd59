"""Scheduled requests and pools on the CPU, as the batch builder's tests need them."""

from __future__ import annotations

import torch

from backplane.contracts.memory import ReqToTokenPool, TokenToKVPool
from backplane.scheduler.request import Req
from backplane.scheduler.sampling_params import SamplingParams


def cpu_pools(rows: int, context: int, slots: int) -> tuple[ReqToTokenPool, TokenToKVPool]:
    """A request pool of `rows` rows of `context` tokens and a one-layer KV pool of `slots` slots."""
    return ReqToTokenPool(rows, context, "cpu"), TokenToKVPool(slots, 1, 1, 8, torch.float32, "cpu")


def placed_reqs(req_pool: ReqToTokenPool, prompts: list[list[int]], cached: list[int]) -> list[Req]:
    """One request per prompt, each given a row of `req_pool` and its first `cached[i]` tokens cached."""
    reqs = [Req(i, list(p), SamplingParams()) for i, p in enumerate(prompts)]
    for req, n in zip(reqs, cached):
        req.row, req.num_cached = req_pool.alloc(), n
    return reqs


def expected_fields(ids: list[int], positions: list[int], slots: list[int], rows: list[int], prefix: list[int],
                    new: list[int], extend: bool) -> dict[str, tuple[list[int], torch.dtype]]:
    """A built batch's fields as (values, dtype): the lengths of requests with `prefix[i]` cached and
    `new[i]` new tokens; the extend lengths only for an extend batch."""
    seq = [p + k for p, k in zip(prefix, new)]
    want = {"input_ids": (ids, torch.int64), "positions": (positions, torch.int64),
            "out_cache_loc": (slots, torch.int64), "req_pool_indices": (rows, torch.int64),
            "seq_lens": (seq, torch.int32), "seq_lens_cpu": (seq, torch.int32)}
    if extend:
        want.update(extend_prefix_lens=(prefix, torch.int32), extend_seq_lens=(new, torch.int32),
                    extend_prefix_lens_cpu=(prefix, torch.int32), extend_seq_lens_cpu=(new, torch.int32))
    return want
