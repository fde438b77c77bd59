"""Requests of one generate call share their prefixes: the first request of a group computes the
group's prefix, the others wait for it and prefill only their own suffix; with a tight pool the
waiting queue goes longest cached prefix first. Counted with the engine's prefill_tokens and,
independently, with a wrapper around the runner's forward; greedy outputs equal those without the
cache."""

from __future__ import annotations

import random

import pytest
import torch

from backplane import Engine, SamplingParams
from backplane.scheduler.prefix_cache import IN_BATCH_SHARE_MIN, LPM_MAX_WAITING, PrefixCache
from backplane.scheduler.request import Req
from backplane.contracts.memory import ReqToTokenPool, TokenToKVPool
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
    engine = Engine("tiny-llama", **CPU, **{"max_total_tokens": 4096, **settings})
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


def test_a_tight_pool_admits_cached_prefixes_first():
    """Three requests run at once and the pool holds about two prefixes: admitted in arrival order
    (A1 B1 C1 D1 A2 ...) each wave would evict the prefixes the next wave needs (1728 tokens
    computed instead of 448); longest cached prefix first, every prefix is computed once."""
    prompts = shared_workload(4, 6, shuffle=False)
    tight = dict(max_total_tokens=200, max_running_requests=3)
    outs, prefill, counted = serve(prompts, **tight)
    want, _, _ = serve(prompts, **tight, disable_radix_cache=True)
    assert outs == want
    assert prefill == counted == 4 * PREFIX_LEN + len(prompts) * SUFFIX_LEN


def make_cache(num_slots: int = 64) -> PrefixCache:
    return PrefixCache(TokenToKVPool(num_slots, 1, 1, 2, torch.float32, "cpu"), ReqToTokenPool(4, 32, "cpu"))


def cache_prompt(cache: PrefixCache, ids: list[int], lora: str | None = None) -> None:
    cache.tree.insert(ids, cache.kv_pool.alloc(len(ids)), lora)


def test_admission_order_is_longest_cached_prefix_first_then_arrival():
    cache = make_cache()
    cache_prompt(cache, [1, 2, 3, 4, 5, 6])
    cache_prompt(cache, [7, 8, 9], "a")
    waiting = [Req(0, [9, 9, 9], GREEDY), Req(1, [1, 2, 3, 0], GREEDY), Req(2, [7, 8, 9, 0], GREEDY, lora="a"),
               Req(3, [1, 2, 3, 4, 5, 6, 0], GREEDY), Req(4, [7, 8, 9, 0], GREEDY), Req(5, [1, 2, 0], GREEDY)]
    # cached lengths: 0, 3, 3 (adapter a's copy), 6, 0 (the base model has no 7 8 9), 2
    assert [r.rid for r in cache.admission_order(waiting)] == [3, 1, 2, 5, 0, 4]
    nodes = sum(1 for _ in cache.tree.nodes())
    assert nodes == 2 and cache.tree.evictable_size == 9  # ordering read the tree, split nothing
    # A preempted request is looked up with its output (all but the last token, which has no KV).
    again = Req(6, [1, 2, 3], GREEDY, output_ids=[4, 5, 6])
    assert [r.rid for r in cache.admission_order([waiting[1], again])] == [6, 1]


def test_admission_order_keeps_arrival_order_when_off_or_the_queue_is_long():
    cache = make_cache()
    cache_prompt(cache, [1, 2, 3])
    waiting = [Req(0, [5, 5], GREEDY), Req(1, [1, 2, 3, 0], GREEDY)]
    assert [r.rid for r in cache.admission_order(waiting)] == [1, 0]
    long_queue = waiting + [Req(2 + i, [5, 5], GREEDY) for i in range(LPM_MAX_WAITING)]
    assert cache.admission_order(long_queue) == long_queue
    off = PrefixCache(cache.kv_pool, cache.req_pool, enabled=False)
    assert off.admission_order(waiting) == waiting
