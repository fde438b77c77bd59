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
