"""The scheduler's step runs under torch.inference_mode (its batch building and sampling skip
autograd's dispatch, as the forward already does), and what it leaves behind still works outside it."""

from __future__ import annotations

import torch

from backplane import Engine, SamplingParams
from backplane.scheduler import batch_builder, launcher

TINY = dict(device="cpu", max_total_tokens=2048, max_running_requests=8)


def test_batches_are_built_and_sampled_under_inference_mode(monkeypatch):
    seen = []
    build, sample = batch_builder._make_batch, launcher.sample

    def spy_build(*args, **kwargs):
        seen.append(("build", torch.is_inference_mode_enabled()))
        return build(*args, **kwargs)

    def spy_sample(*args, **kwargs):
        seen.append(("sample", torch.is_inference_mode_enabled()))
        return sample(*args, **kwargs)

    monkeypatch.setattr(batch_builder, "_make_batch", spy_build)
    monkeypatch.setattr(launcher, "sample", spy_sample)
    engine = Engine("tiny-llama", **TINY)
    engine.generate(input_ids=[[5, 6, 7, 8], [9, 10]], sampling_params=SamplingParams(max_new_tokens=3, temperature=0))
    assert {kind for kind, _ in seen} == {"build", "sample"}
    assert all(mode for _, mode in seen), seen
    assert not torch.is_inference_mode_enabled()


def test_state_left_by_steps_serves_calls_and_cache_flushes_outside_it():
    """Slots, rows and the cache's tensors made inside steps are freed, evicted and reused by later
    calls and by flush_cache, which run outside inference mode."""
    engine = Engine("tiny-llama", **TINY)
    params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    prompts = [[3 + i, 40, 41, 42, 43 + i] * 3 for i in range(5)]
    first = engine.generate(input_ids=prompts, sampling_params=params)
    again = engine.generate(input_ids=prompts, sampling_params=params)  # from the cache
    engine.flush_cache()
    third = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in first] == [o.token_ids for o in again] == [o.token_ids for o in third]
    pool = engine.runner.token_to_kv_pool
    engine.flush_cache()
    assert pool.num_free == pool.num_slots
