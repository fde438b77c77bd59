"""Soak (CPU, bounded): 2,000 requests of random lengths, sampling settings, LoRA adapters and stop
strings through a KV pool far smaller than the total need. Every request finishes, greedy ones
equal running them alone, the pools come back whole and memory does not grow."""

from __future__ import annotations

import random
import resource

import pytest

from backplane import Engine, SamplingParams
from lora_helpers import make_lora_world

NUM_REQUESTS, ROUNDS = 2000, 4


def _request(rng: random.Random, adapters: list[str]):
    prompt = [rng.randrange(3, 290) for _ in range(rng.randint(1, 40))]
    greedy = rng.random() < 0.6
    params = SamplingParams(
        max_new_tokens=rng.randint(1, 12), temperature=0.0 if greedy else rng.choice([0.5, 1.0]),
        top_k=rng.choice([0, 5, 50]), top_p=rng.choice([1.0, 0.9]), min_p=rng.choice([0.0, 0.05]),
        seed=None if greedy else rng.randrange(1 << 30), stop=["e"] if rng.random() < 0.2 else [],
        ignore_eos=True)
    return prompt, params, rng.choice([None, *adapters])


def _max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.slow
def test_soak(tmp_path):
    world = make_lora_world(tmp_path)
    engine = Engine(str(world.base_dir), device="cpu", attention_backend="torch_native",
                    lora_paths=world.lora_paths(), max_loras_per_batch=2, max_total_tokens=256,
                    max_running_requests=12, chunked_prefill_size=64)
    kv_start, rows_start = engine.runner.token_to_kv_pool.num_free, engine.runner.req_to_token_pool.num_free
    rng = random.Random(7)
    requests = [_request(rng, list(world.adapter_dirs)) for _ in range(NUM_REQUESTS)]
    # The pool holds 256 tokens; the requests need tens of thousands between them.
    assert sum(len(p) + s.max_new_tokens for p, s, _ in requests) > 50 * 256
    outputs, rss_after_first = [], None
    per_round = NUM_REQUESTS // ROUNDS
    for r in range(ROUNDS):
        chunk = requests[r * per_round:(r + 1) * per_round]
        outputs += engine.generate(input_ids=[p for p, _, _ in chunk], sampling_params=[s for _, s, _ in chunk],
                                   lora=[a for _, _, a in chunk])
        rss_after_first = rss_after_first or _max_rss_mb()
        assert engine.runner.token_to_kv_pool.num_free == kv_start
        assert engine.runner.req_to_token_pool.num_free == rows_start
    assert len(outputs) == NUM_REQUESTS
    for (_, params, _), out in zip(requests, outputs):
        assert out.error is None and out.finish_reason in ("stop", "length")
        assert 1 <= len(out.token_ids) <= params.max_new_tokens
        assert out.finish_reason == "stop" or len(out.token_ids) == params.max_new_tokens
        if out.finish_reason == "stop":
            assert "e" not in out.text
    assert _max_rss_mb() - rss_after_first < 64, "memory grew over the soak"
    greedy = [i for i, (_, s, _) in enumerate(requests) if s.temperature == 0][:60]
    for i in greedy:
        prompt, params, adapter = requests[i]
        alone = engine.generate(input_ids=[prompt], sampling_params=params, lora=adapter)[0]
        assert alone.token_ids == outputs[i].token_ids, f"request {i} differs when run alone"
