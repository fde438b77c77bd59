"""Choosing the verified tree among the drafted candidates: the best paths by log-probability."""

from __future__ import annotations

import torch

from backplane.speculative import DraftTree

from .beams import Candidates


def select_tree(roots: list[int], candidates: Candidates, num_nodes: int) -> DraftTree:
    """Keep the num_nodes - 1 candidates of highest path log-probability, plus the root.

    A child's score never exceeds its parent's (log-probabilities are <= 0) and a stable sort puts
    the parent (smaller id) first on ties, so the kept set always contains every kept node's parent.
    """
    # One device-to-host copy (float64 holds the token ids, node ids and fp32 scores exactly).
    packed = torch.stack([t.to(torch.float64) for t in (candidates.tokens, candidates.scores, candidates.parents)]).cpu()
    tokens, scores, parents = packed[0].to(torch.int64), packed[1], packed[2].to(torch.int64)
    bs, count = scores.shape
    keep = torch.sort(-scores, dim=1, stable=True).indices[:, : num_nodes - 1].sort(dim=1).values
    where = torch.full((bs, count + 1), -1, dtype=torch.int64)  # node id -> index in the tree
    where[:, 0] = 0
    where.scatter_(1, keep + 1, torch.arange(1, num_nodes).expand(bs, -1).contiguous())
    tree_parents = where.gather(1, parents.gather(1, keep))
    assert bool((tree_parents >= 0).all()), "a kept draft node lost its parent"
    tree_tokens = torch.cat([torch.tensor(roots)[:, None], tokens.gather(1, keep)], 1)
    parents_full = torch.cat([torch.full((bs, 1), -1, dtype=torch.int64), tree_parents], 1)
    return DraftTree(tree_tokens.to(torch.int64), parents_full)
