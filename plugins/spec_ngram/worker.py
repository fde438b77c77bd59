"""NgramWorker: drafts by prompt lookup.

For each request, find the most recent earlier occurrence of its last n tokens (n from
MAX_NGRAM down to MIN_NGRAM) in prompt + output, and propose the tokens that followed it, as a
chain of num_draft_tokens - 1 drafts. Without a match (or when the continuation is short) the
chain is filled by repeating the last token; such drafts are simply rejected by verify.
"""

from __future__ import annotations

import torch

from backplane.speculative import DraftTree, SpecRequest, SpecWorker

MAX_NGRAM = 4
MIN_NGRAM = 1


def lookup(ids: list[int], num: int, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> list[int]:
    """Up to `num` tokens that followed the latest earlier match of the longest suffix n-gram of `ids`."""
    for n in range(min(max_ngram, len(ids) - 1), min_ngram - 1, -1):
        suffix = ids[-n:]
        # Search right to left, excluding the suffix itself.
        for start in range(len(ids) - n - 1, -1, -1):
            if ids[start:start + n] == suffix:
                follow = ids[start + n:start + n + num]
                if follow:
                    return follow
    return []


class NgramWorker(SpecWorker):
    """Prompt-lookup drafts as chains, verified by the shared greedy path."""

    def draft(self, reqs: list[SpecRequest]) -> DraftTree:
        num = self.num_draft_tokens - 1
        rows = []
        for req in reqs:
            ids = req.token_ids
            proposal = lookup(ids, num)
            rows.append([ids[-1]] + proposal + [ids[-1]] * (num - len(proposal)))
        return DraftTree.chain(torch.tensor(rows, dtype=torch.int64))
