"""KV accounting of a speculative step: allocate slots for every verify token, keep the accepted
ones in position order, free the rejected ones.

Invariant kept for each request: `torch.cat(req.slots)` lists the slots of positions
0..num_cached-1 in order, and `req_to_token[row, :num_cached]` holds the same slots.
"""

from __future__ import annotations

import torch

from backplane.contracts.memory import ReqToTokenPool, TokenToKVPool


def alloc_verify_slots(reqs: list, num_nodes: int, kv_pool: TokenToKVPool, req_pool: ReqToTokenPool) -> torch.Tensor:
    """Give each request `num_nodes` slots for positions num_cached .. num_cached + num_nodes - 1.

    The slots are appended to `req.slots` (so a release frees them) and written into req_to_token.
    Returns them as a host int64 tensor [len(reqs) * num_nodes], request after request.
    """
    slots = kv_pool.alloc(len(reqs) * num_nodes)
    rows, cols = [], []
    for i, req in enumerate(reqs):
        req.slots.append(slots[i * num_nodes:(i + 1) * num_nodes])
        rows += [req.row] * num_nodes
        cols += range(req.num_cached, req.num_cached + num_nodes)
    _write_rows(req_pool, rows, cols, slots)
    return slots


def commit_accepted(reqs: list, paths: list[list[int]], kv_pool: TokenToKVPool, req_pool: ReqToTokenPool) -> None:
    """After verify: request i keeps the slots of the nodes on paths[i] (at positions num_cached ..),
    frees the slots of every other node, and advances num_cached by len(paths[i]).

    Each request's last `req.slots` entry must be its verify slots (from `alloc_verify_slots`).
    """
    freed, rows, cols, kept_all = [], [], [], []
    for req, path in zip(reqs, paths):
        verify_slots = req.slots[-1].tolist()
        on_path = set(path)
        kept = [verify_slots[n] for n in path]  # in path (= position) order
        freed += [slot for n, slot in enumerate(verify_slots) if n not in on_path]
        req.slots[-1] = torch.tensor(kept, dtype=torch.int64)
        rows += [req.row] * len(path)
        cols += range(req.num_cached, req.num_cached + len(path))
        kept_all += kept
        req.num_cached += len(path)
    if kept_all:
        _write_rows(req_pool, rows, cols, kept_all)
        kv_pool.free(torch.tensor(freed, dtype=torch.int64))


def _write_rows(req_pool: ReqToTokenPool, rows: list[int], cols: list[int], slots: torch.Tensor | list[int]) -> None:
    """req_to_token[rows[i], cols[i]] = slots[i], through one host-to-device copy."""
    r2t = req_pool.req_to_token
    slots = slots.tolist() if isinstance(slots, torch.Tensor) else slots
    where = torch.tensor([rows, list(cols), slots], dtype=torch.int64).to(r2t.device, non_blocking=True)
    r2t[where[0], where[1]] = where[2].to(torch.int32)
