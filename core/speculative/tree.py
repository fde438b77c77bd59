"""Draft trees: which verify token descends from which, and the attention mask that says so.

A request's draft is a tree of `num_nodes` tokens in topological order. Node 0 is the root: the
last token the target has chosen (not yet in the KV cache); every other node is a drafted token
whose parent has a smaller index. Verify feeds all nodes at once; node i sits at position
`num_cached + depth[i]` and may see the request's cached prefix plus its own ancestors and itself.
A chain (ngram, EAGLE with top-k 1) is the tree whose parent of node i is i - 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    """The drafts of a batch.

    tokens: [bs, num_nodes] int64 on the host, tokens[:, 0] is the root (the last verified token);
      None while they are only on the device (`device_tokens`): verify then feeds them to the
      target without waiting for the draft, and fills `tokens` with its own device-to-host copy
    parents: [bs, num_nodes] int64 on the host, parents[:, 0] == -1 and parents[:, i] < i
    device_tokens: [bs, num_nodes] int64 on the device, or None
    """

    tokens: torch.Tensor | None
    parents: torch.Tensor
    device_tokens: torch.Tensor | None = None

    def __post_init__(self):
        assert self.tokens is not None or self.device_tokens is not None, "a draft tree needs its tokens"
        shape = (self.tokens if self.tokens is not None else self.device_tokens).shape
        assert shape == self.parents.shape, "tokens and parents must have one shape"
        assert bool((self.parents[:, 0] == -1).all()), "node 0 is the root (parent -1)"
        idx = torch.arange(self.num_nodes)
        assert bool((self.parents[:, 1:] < idx[1:]).all()), "a parent must come before its child"
        assert bool((self.parents[:, 1:] >= 0).all()), "only node 0 may lack a parent"
        self.ancestors = ancestor_matrix(self.parents)  # [bs, n, n]
        self.depths = self.ancestors.sum(-1) - 1  # [bs, n]

    @property
    def batch_size(self) -> int:
        return int(self.parents.shape[0])

    @property
    def num_nodes(self) -> int:
        return int(self.parents.shape[1])

    @classmethod
    def chain(cls, tokens: torch.Tensor) -> DraftTree:
        """tokens [bs, n]: node i's parent is node i - 1."""
        bs, n = tokens.shape
        parents = (torch.arange(n, dtype=torch.int64) - 1).expand(bs, n).clone()
        return cls(tokens.to(torch.int64), parents)


def ancestor_matrix(parents: torch.Tensor) -> torch.Tensor:
    """parents [bs, n] -> [bs, n, n] bool; [b, i, j] is True when node j is node i or one of its ancestors."""
    bs, n = parents.shape
    if bool((parents == torch.arange(-1, n - 1)).all()):  # a chain: node i descends from every j <= i
        return torch.ones(n, n, dtype=torch.bool).tril().expand(bs, n, n).clone()
    anc = torch.eye(n, dtype=torch.bool).expand(bs, n, n).clone()
    rows = torch.arange(bs)
    for i in range(1, n):  # parents come first, so their rows are complete already
        anc[:, i] |= anc[rows, parents[:, i]]
    return anc


def verify_mask(tree: DraftTree, prefix_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The custom mask of a TARGET_VERIFY batch (see ForwardBatch) and its mask_indptr.

    Request b's block is a row-major [num_nodes, prefix_lens[b] + num_nodes] bool matrix: every
    node sees the whole cached prefix, then its ancestors and itself among the nodes.
    Returns (custom_mask: [sum of block sizes] bool, mask_indptr: [bs + 1] int64), on the host.
    """
    n = tree.num_nodes
    blocks = []
    for b, prefix in enumerate(prefix_lens):
        block = torch.ones((n, prefix + n), dtype=torch.bool)
        block[:, prefix:] = tree.ancestors[b]
        blocks.append(block.view(-1))
    sizes = torch.tensor([n * (p + n) for p in prefix_lens], dtype=torch.int64)
    indptr = torch.zeros(len(prefix_lens) + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(sizes, 0)
    return torch.cat(blocks), indptr
