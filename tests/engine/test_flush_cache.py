"""Engine.flush_cache: an emptied prefix cache between runs (what benchmarks start each timed run from)."""

from __future__ import annotations

from backplane import Engine, SamplingParams


def test_flush_cache_empties_the_prefix_cache_between_runs():
    engine = Engine("tiny-llama", device="cpu", max_total_tokens=512)
    params = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
    prompt = [list(range(5, 40))]
    engine.generate(input_ids=prompt, sampling_params=params)
    engine.generate(input_ids=prompt, sampling_params=params)
    hits = engine.stats()["prefix_cache"]["hit_tokens"]
    assert hits > 0
    engine.flush_cache()
    engine.generate(input_ids=prompt, sampling_params=params)
    assert engine.stats()["prefix_cache"]["hit_tokens"] == hits  # a flushed cache has nothing to hit
