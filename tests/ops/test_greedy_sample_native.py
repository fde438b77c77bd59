"""The native `greedy_sample` op and the sampler's use of it: an all-greedy batch runs the op it is
given and nothing else, with the results the sampler gave before the op existed; other batches keep
their path."""

from __future__ import annotations

import torch

from backplane.layers.sampler import SamplingBatch, sample
from backplane.ops.dispatch import CustomOps
from backplane.ops.native import NATIVE_OPS, greedy_sample


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 4


def old_greedy(logits):
    """What `sample` computed for an all-greedy batch before the op (commit abc8fff), written out here."""
    logprobs = torch.log_softmax(logits, dim=-1)
    greedy = logits.argmax(dim=-1)
    return greedy, logprobs.gather(1, greedy.unsqueeze(1)).squeeze(1)


def greedy_batch(bs):
    empty = torch.empty(0)
    return SamplingBatch(empty, empty, empty, empty, [None] * bs, all_greedy=True)


def test_native_equals_the_old_formula_bit_for_bit():
    logits = randn(7, 1000)
    logits[3, [10, 500]] = 30.0  # a tie: the first index
    logits[4, :] = -float("inf")
    tokens, logprobs = greedy_sample(logits)
    want_tokens, want_logprobs = old_greedy(logits)
    assert tokens[3] == 10 and tokens.dtype == torch.int64
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logprobs, want_logprobs, rtol=0, atol=0, equal_nan=True)


def test_registered_and_in_the_native_table():
    assert NATIVE_OPS["greedy_sample"] is greedy_sample
    assert CustomOps.native().greedy_sample is greedy_sample


def test_an_all_greedy_batch_runs_the_op_it_is_given():
    logits, calls = randn(3, 50, seed=1), []

    def spy(x):
        calls.append(x)
        return greedy_sample(x)

    tokens, logprobs = sample(logits, greedy_batch(3), None, spy)
    assert len(calls) == 1 and calls[0] is logits
    want = old_greedy(logits)
    assert torch.equal(tokens, want[0]) and torch.equal(logprobs, want[1])
    # without an op: the native one, the same results
    tokens, logprobs = sample(logits, greedy_batch(3))
    assert torch.equal(tokens, want[0]) and torch.equal(logprobs, want[1])


def test_a_sampled_batch_keeps_its_path():
    logits, calls = randn(2, 50, seed=2), []
    batch = SamplingBatch(torch.tensor([0.0, 0.7]), torch.zeros(2, dtype=torch.int64), torch.ones(2),
                          torch.zeros(2), [None, None], all_greedy=False)
    tokens, logprobs = sample(logits, batch, torch.Generator().manual_seed(0), lambda x: calls.append(x))
    assert calls == []
    assert tokens[0] == logits[0].argmax()  # temperature 0: greedy within a sampled batch
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).gather(1, tokens.unsqueeze(1)).squeeze(1))
