"""The shared speculative contract on CPU: tree masks, greedy acceptance, KV accounting and
tree selection, each against a reference written here."""

from __future__ import annotations

import random

import pytest
import torch

from backplane.contracts.memory import ReqToTokenPool, TokenToKVPool
from backplane.plugins.spec_eagle.beams import Candidates
from backplane.plugins.spec_eagle.worker import select_tree
from backplane.speculative import DraftTree, alloc_verify_slots, commit_accepted, verify_greedy, verify_mask


def _reference_ancestors(parents: list[int]) -> list[set[int]]:
    out = []
    for i in range(len(parents)):
        chain, node = {i}, i
        while parents[node] >= 0:
            node = parents[node]
            chain.add(node)
        out.append(chain)
    return out


def _random_tree(rng: random.Random, n: int) -> list[int]:
    return [-1] + [rng.randrange(0, i) for i in range(1, n)]


def test_ancestors_depths_and_mask_match_a_reference():
    rng = random.Random(0)
    parents = [_random_tree(rng, 7), _random_tree(rng, 7), list(range(-1, 6))]
    tokens = torch.randint(3, 100, (3, 7))
    tree = DraftTree(tokens, torch.tensor(parents))
    prefix = [5, 0, 13]
    mask, indptr = verify_mask(tree, prefix)
    for b, p in enumerate(parents):
        anc = _reference_ancestors(p)
        assert tree.depths[b].tolist() == [len(a) - 1 for a in anc]
        block = mask[indptr[b]:indptr[b + 1]].view(7, prefix[b] + 7)
        assert bool(block[:, : prefix[b]].all())
        want = torch.tensor([[j in anc[i] for j in range(7)] for i in range(7)])
        assert torch.equal(block[:, prefix[b]:], want)
    assert DraftTree.chain(tokens).depths[0].tolist() == list(range(7))


def test_bad_tree_is_rejected():
    with pytest.raises(AssertionError, match="parent must come before"):
        DraftTree(torch.zeros(1, 3, dtype=torch.int64), torch.tensor([[-1, 2, 0]]))


def _reference_accept(tokens, parents, choice):
    """Step-by-step greedy decoding replayed on the tree."""
    node, out = 0, []
    while True:
        nxt = choice[node]
        out.append(nxt)
        kids = [c for c in range(1, len(tokens)) if parents[c] == node and tokens[c] == nxt]
        if not kids:
            return out
        node = kids[0]


def test_verify_greedy_against_step_by_step_replay():
    rng = random.Random(1)
    for _ in range(200):
        n = rng.randint(1, 9)
        parents = _random_tree(rng, n)
        tokens = [rng.randrange(0, 3) for _ in range(n)]  # a tiny vocabulary: many matches
        choice = [rng.randrange(0, 3) for _ in range(n)]
        tree = DraftTree(torch.tensor([tokens]), torch.tensor([parents]))
        acc = verify_greedy(tree, torch.tensor([choice]))[0]
        assert acc.new_tokens == _reference_accept(tokens, parents, choice)
        assert acc.path[0] == 0 and len(acc.path) == len(acc.new_tokens)
        assert all(parents[b] == a for a, b in zip(acc.path, acc.path[1:]))


class _Req:
    def __init__(self, row, num_cached):
        self.row, self.num_cached, self.slots = row, num_cached, []


def test_kv_accounting_keeps_accepted_slots_in_order_and_frees_the_rest():
    kv, rows = TokenToKVPool(64, 1, 1, 4, torch.float32, "cpu"), ReqToTokenPool(4, 32, "cpu")
    reqs = [_Req(rows.alloc(), 0), _Req(rows.alloc(), 0)]
    for req, n in zip(reqs, (5, 9)):  # a prefix in the cache
        req.slots.append(kv.alloc(n))
        rows.req_to_token[req.row, :n] = req.slots[0].to(torch.int32)
        req.num_cached = n
    start = kv.num_free
    slots = alloc_verify_slots(reqs, 6, kv, rows)
    assert kv.num_free == start - 12
    assert torch.equal(rows.req_to_token[reqs[1].row, 9:15].long(), slots[6:])
    commit_accepted(reqs, [[0, 2, 5], [0]], kv, rows)
    assert kv.num_free == start - 4
    assert [r.num_cached for r in reqs] == [8, 10]
    assert reqs[0].slots[-1].tolist() == [slots[0].item(), slots[2].item(), slots[5].item()]
    for req in reqs:
        assert torch.equal(torch.cat(req.slots), rows.req_to_token[req.row, : req.num_cached].long())
        kv.free(torch.cat(req.slots))
    assert kv.num_free == 64


def test_select_tree_keeps_the_best_nodes_and_their_parents():
    # root's children 1, 2 (ids); 1's children 3, 4; 2's children 5, 6 (candidate index = id - 1)
    scores = torch.tensor([[-0.1, -2.0, -0.3, -0.2, -2.5, -3.0]])
    parents = torch.tensor([[0, 0, 1, 1, 2, 2]])
    tokens = torch.tensor([[11, 12, 13, 14, 15, 16]])
    tree = select_tree([7], Candidates(tokens, scores, parents), num_nodes=4)
    assert tree.tokens.tolist() == [[7, 11, 13, 14]]
    assert tree.parents.tolist() == [[-1, 0, 1, 1]]
    # Equal scores: the parent (smaller id) wins, so the tree stays closed.
    tree = select_tree([7], Candidates(tokens, torch.zeros(1, 6), parents), num_nodes=3)
    assert tree.parents.tolist() == [[-1, 0, 0]]


def test_padded_verify_view_gives_the_same_logits():
    """What a verify graph replay sees (pad_into): padded requests with an all-visible mask do not
    change the real requests' logits (torch_native, eagerly, on the padded view)."""
    from backplane import Engine, SamplingParams
    from backplane.contracts.batch import ForwardMode
    from backplane.executor.graph_runner import StaticInputs, pad_into
    from backplane.contracts.graph import GraphKey

    engine = Engine("tiny-llama", device="cpu", attention_backend="torch_native", max_total_tokens=2048,
                    max_running_requests=8, speculative_algorithm="ngram", speculative_num_draft_tokens=5)
    runner = engine.runner
    static = StaticInputs.allocate(8, 8 * 5, "cpu", mask_size=8 * 5 * runner.req_to_token_pool.max_context_len)
    checked = []

    def forward(batch, capture_hidden=False):
        out = runner.forward_eager(batch, capture_hidden=capture_hidden)
        if batch.forward_mode is ForwardMode.TARGET_VERIFY:
            key = GraphKey(ForwardMode.TARGET_VERIFY, batch.batch_size + 3, 5)
            padded = pad_into(static, batch, key, runner.req_to_token_pool.size - 1, fill=5)
            assert padded.custom_mask.numel() == int(padded.mask_indptr[-1])
            assert padded.extend_prefix_lens_cpu.tolist()[-3:] == [0, 0, 0]
            again = runner.forward_eager(padded)
            torch.testing.assert_close(again.logits[: batch.num_tokens], out.logits, atol=1e-5, rtol=1e-5)
            checked.append(batch.batch_size)
        return out

    runner.forward = forward
    outs = engine.generate(input_ids=[[5, 6, 7, 5, 6], list(range(3, 40))],
                           sampling_params=SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
    assert all(o.error is None for o in outs) and checked
