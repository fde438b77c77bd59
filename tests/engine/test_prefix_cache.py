"""Prefix caching end to end: greedy outputs with the radix cache equal those without it (shared,
partly shared and unshared prompts; chunked prefill; a tight pool that evicts and preempts; LoRA;
ngram speculation), the cache really hits (fewer prompt tokens are computed), adapters never share."""

from __future__ import annotations

import pytest

from backplane import Engine, SamplingParams
from helpers_models import count_computed_tokens, unused_slots
from lora_helpers import make_lora_world

CPU = dict(device="cpu", dtype="float32", load_format="dummy", disable_cuda_graph=True, seed=3)
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
SYSTEM = list(range(5, 65))  # a 60-token shared prefix
PROMPTS = ([SYSTEM + [100 + i, 7, 8 + i] for i in range(5)]  # shared
           + [SYSTEM[:30] + [200 + i] * 4 for i in range(3)]  # partly shared
           + [[300 + i, 9, 40 + i, 11] * 5 for i in range(3)])  # unshared


def serve_twice(**settings):
    """Outputs of two rounds of PROMPTS (the second can hit what the first cached), the tokens each
    round computed in prefills, and the engine."""
    engine = Engine("tiny-llama", **CPU, **settings)
    counts = count_computed_tokens(engine)
    first = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    first_tokens = sum(counts)
    second = engine.generate(input_ids=PROMPTS[::-1], sampling_params=GREEDY)[::-1]
    assert unused_slots(engine) == engine.runner.token_to_kv_pool.num_slots
    return [o.token_ids for o in first], [o.token_ids for o in second], (first_tokens, sum(counts) - first_tokens), engine


@pytest.fixture(scope="module")
def uncached():
    return serve_twice(max_total_tokens=2048, disable_radix_cache=True)


@pytest.mark.parametrize("settings", [
    dict(max_total_tokens=2048),
    dict(max_total_tokens=2048, chunked_prefill_size=16),
    dict(max_total_tokens=150, chunked_prefill_size=32, max_running_requests=3),  # evicts and preempts
], ids=["roomy", "chunked", "tight"])
def test_greedy_outputs_equal_without_the_cache(settings, uncached):
    first, second, (tokens1, tokens2), engine = serve_twice(**settings)
    want_first, want_second, (plain1, plain2), _ = uncached
    assert first == want_first and second == want_second
    stats = engine.stats()["prefix_cache"]
    assert stats["enabled"] and stats["hit_tokens"] > 0
    assert tokens1 < plain1 and tokens2 < plain2  # the cache saved prefill work in both rounds
    if settings["max_total_tokens"] == 2048:
        # Round 2 finds every prompt cached (but its last token, whose logits are needed).
        assert tokens2 == len(PROMPTS)


def test_stats_count_hits_and_queries(uncached):
    *_, engine = uncached
    stats = engine.stats()["prefix_cache"]
    assert stats == dict(stats, enabled=False, hit_tokens=0, disabled_reason="--disable-radix-cache")
    assert stats["query_tokens"] == 2 * sum(len(p) for p in PROMPTS)
    _, _, _, cached = serve_twice(max_total_tokens=2048)
    got = cached.stats()["prefix_cache"]
    assert got["query_tokens"] == stats["query_tokens"]
    assert 0.5 < got["hit_rate"] == got["hit_tokens"] / got["query_tokens"] < 1


def test_ngram_speculation_with_the_cache_equals_plain_greedy(uncached):
    first, second, _, engine = serve_twice(max_total_tokens=2048, speculative_algorithm="ngram",
                                           speculative_num_draft_tokens=3)
    want_first, want_second, _, _ = uncached
    assert first == want_first and second == want_second
    assert engine.stats()["prefix_cache"]["hit_tokens"] > 0


def test_adapters_never_share_kv(tmp_path_factory):
    world = make_lora_world(tmp_path_factory.mktemp("radix_lora"))
    settings = dict(device="cpu", dtype="float32", max_total_tokens=1024, lora_paths=world.lora_paths(),
                    lora_backend="torch_native", disable_cuda_graph=True)
    prompt = list(range(3, 43))
    prompts = [prompt + [50 + i] for i in range(6)]
    adapters = ["all7_r4", None, "qv_down_r8", "all7_r4", None, "qv_down_r8"]
    outs = {}
    for disable in (True, False):
        engine = Engine(str(world.base_dir), disable_radix_cache=disable, **settings)
        first = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora=adapters)
        prefilled = engine.stats()["prefix_cache"]["prefill_tokens"]
        again = engine.generate(input_ids=prompts[:3], sampling_params=GREEDY, lora=adapters[:3])
        outs[disable] = [o.token_ids for o in first + again]
        if not disable:
            # In one call each adapter computes the prompt once (its second request waits for that
            # and computes its last token only), and never reads another adapter's copy.
            assert prefilled == 3 * len(prompts[0]) + 3
            tree = engine.scheduler.prefix_cache.tree
            assert set(tree.roots) == {None, "all7_r4", "qv_down_r8"}
            for name in (None, "all7_r4", "qv_down_r8"):  # each adapter cached its own copy of the prompt
                assert tree.match(prompt, name).length == len(prompt)
            assert tree.match(prompt, "kogu_r2").length == 0
    assert outs[False] == outs[True]
    assert len({tuple(t) for t in outs[True][:3]}) == 3  # the adapters do change the output
