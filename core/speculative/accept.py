"""Greedy acceptance: keep the longest draft path the target itself would have produced.

The rule (restated from the papers, for greedy decoding):
  Verify gives, for every node of the tree, the target's greedy choice for the token that follows
  it. Starting at the root, a child node is accepted when its token equals the target's choice at
  its parent; we descend while some child is accepted. The tokens on the accepted path, followed
  by the target's choice at the last accepted node (the "bonus" token), are exactly what greedy
  decoding without speculation would have produced, one step at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backplane.speculative.tree import DraftTree


@dataclass
class Accepted:
    """One request's outcome of verify.

    path: node indices from the root (0) to the last accepted node, in depth order
    new_tokens: the accepted drafts then the bonus token (len(path) tokens)
    """

    path: list[int]
    new_tokens: list[int]

    @property
    def num_accepted_drafts(self) -> int:
        return len(self.path) - 1


def verify_greedy(tree: DraftTree, target_choice: torch.Tensor) -> list[Accepted]:
    """tree: the drafts; target_choice [bs, num_nodes] int64, the target's argmax after each node."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    choice = target_choice.tolist()
    return [_walk(tokens[b], parents[b], choice[b]) for b in range(tree.batch_size)]


def _walk(tokens: list[int], parents: list[int], choice: list[int]) -> Accepted:
    children: dict[int, list[int]] = {}
    for node in range(1, len(tokens)):
        children.setdefault(parents[node], []).append(node)
    path = [0]
    while True:
        node = path[-1]
        # A child is accepted when its token is what the target picks after its parent.
        match = next((c for c in children.get(node, ()) if tokens[c] == choice[node]), None)
        if match is None:
            break
        path.append(match)
    # The target's own choice after the last accepted node is always correct: the bonus token.
    new_tokens = [tokens[n] for n in path[1:]] + [choice[path[-1]]]
    return Accepted(path, new_tokens)
