"""Requests of one generate call share their prefixes: the first request of a group computes the
group's prefix, the others wait for it and prefill only their own suffix. Counted with the engine's
prefill_tokens and, independently, with a wrapper around the runner's forward; greedy outputs equal
those without the cache."""

from __future__ import annotations

import random

import pytest

from backplane import Engine, SamplingParams
from backplane.engine.prefix_cache import IN_BATCH_SHARE_MIN
from helpers_models import count_computed_tokens, unused_slots

CPU = dict(device="cpu", dtype="float32", load_format="dummy", disable_cuda_graph=True, seed=3)
GREEDY = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
PREFIX_LEN, SUFFIX_LEN = 64, 8  # the prefix is longer than IN_BATCH_SHARE_MIN: waiting for it pays


def shared_workload(num_groups: int, per_group: int, shuffle: bool) -> list[list[int]]:
    """num_groups prefixes of PREFIX_LEN tokens; each request adds SUFFIX_LEN tokens of its own
    (its first suffix token differs from every other request's, so nothing else is shared)."""
    prefixes = [[10 + g] + [20 + (g * 7 + i) % 200 for i in range(PREFIX_LEN - 1)] for g in range(num_groups)]
    prompts = [prefixes[g] + [300 + g * per_group + r] + [5] * (SUFFIX_LEN - 1)
               for r in range(per_group) for g in range(num_groups)]  # interleaved: A1 B1 C1 A2 B2 ...
    if shuffle:
        random.Random(0).shuffle(prompts)
    return prompts


def serve(prompts, **settings):
    """(greedy outputs, prefill_tokens from the stats, tokens counted at the forward)."""
    engine = Engine("tiny-llama", **CPU, max_total_tokens=4096, **settings)
    counted = count_computed_tokens(engine)
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert all(o.error is None for o in outs)
    assert unused_slots(engine) == engine.runner.token_to_kv_pool.num_slots
    return [o.token_ids for o in outs], engine.stats()["prefix_cache"]["prefill_tokens"], sum(counted)


@pytest.mark.parametrize("num_groups, per_group, chunk, shuffle", [
    (4, 6, 8192, True),  # every first request of a group in the first batch; the rest wait one step
    (2, 2, 100, False),  # A1 and the head of B1 in batch 1; B2 must wait for the rest of B1's prefix
    (3, 5, 40, False),  # every prefix takes two chunks; its group waits for both
], ids=["one-batch", "chunk-cuts-a-prefix", "chunked-prefixes"])
def test_one_call_computes_each_prefix_once(num_groups, per_group, chunk, shuffle):
    prompts = shared_workload(num_groups, per_group, shuffle)
    outs, prefill, counted = serve(prompts, chunked_prefill_size=chunk)
    want, plain, plain_counted = serve(prompts, chunked_prefill_size=chunk, disable_radix_cache=True)
    assert outs == want
    assert prefill == counted and plain == plain_counted == len(prompts) * (PREFIX_LEN + SUFFIX_LEN)
    assert prefill == num_groups * PREFIX_LEN + len(prompts) * SUFFIX_LEN  # the ideal


def test_a_short_common_head_does_not_hold_requests_back():
    """Prompts sharing fewer than IN_BATCH_SHARE_MIN tokens go in one batch (nobody waits for the
    shared head); the head is then computed once per request."""
    head = list(range(40, 40 + IN_BATCH_SHARE_MIN - 8))
    prompts = [head + [300 + i] * 20 for i in range(5)]
    engine = Engine("tiny-llama", **CPU, max_total_tokens=4096)
    counted = count_computed_tokens(engine)
    engine.generate(input_ids=prompts, sampling_params=SamplingParams(max_new_tokens=1, ignore_eos=True))
    assert counted[0] == sum(map(len, prompts))  # all five prefilled together in the first step
