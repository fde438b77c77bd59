"""ngram speculation on CPU: greedy output equals plain greedy token for token; pool accounting."""

from __future__ import annotations

import random

import pytest

from backplane import Engine, SamplingParams, SpecAlgorithmSpec, hookimpl
from backplane.plugins.spec_ngram.worker import lookup
from helpers_models import unused_slots

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        # Half of the prompts repeat a motif, so lookup finds matches and full chains get accepted.
        motif = [rng.randrange(3, 500) for _ in range(rng.randint(2, 6))]
        out.append(motif * rng.randint(2, 5) if i % 2 else [rng.randrange(3, 500) for _ in range(rng.randint(1, 40))])
    return out


@pytest.fixture(scope="module")
def plain():
    return Engine("tiny-llama", device="cpu", attention_backend="torch_native", max_total_tokens=4096, max_running_requests=16)


def test_lookup_finds_the_latest_longest_match():
    assert lookup([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]
    assert lookup([5, 6, 7], 3) == []
    assert lookup([4, 4, 4], 5) == [4]
    assert lookup([1, 2, 8, 2], 3) == [8, 2]


@pytest.mark.parametrize("num_draft_tokens, batch", [(4, 1), (4, 7), (2, 5), (6, 16)])
def test_greedy_equals_plain_greedy(plain, num_draft_tokens, batch):
    spec = Engine("tiny-llama", device="cpu", attention_backend="torch_native", max_total_tokens=4096, max_running_requests=16,
                  speculative_algorithm="ngram", speculative_num_draft_tokens=num_draft_tokens)
    prompts = _prompts(num_draft_tokens * 100 + batch, batch)
    params = [SamplingParams(max_new_tokens=random.Random(i).randint(1, 20), **GREEDY) for i in range(batch)]
    want = plain.generate(input_ids=prompts, sampling_params=params)
    got = spec.generate(input_ids=prompts, sampling_params=params)
    for w, g in zip(want, got):
        assert g.error is None
        assert g.token_ids == w.token_ids
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
    stats = spec.spec_worker.stats
    assert 1.0 <= stats.mean_acceptance_length <= num_draft_tokens
    assert unused_slots(spec) == 4096


def test_repetitive_text_gets_long_acceptance():
    spec = Engine("tiny-llama", device="cpu", attention_backend="torch_native", max_total_tokens=4096, speculative_algorithm="ngram",
                  speculative_num_draft_tokens=4)
    plain_out = Engine("tiny-llama", device="cpu", attention_backend="torch_native", max_total_tokens=4096).generate(
        input_ids=[[7, 8, 9]], sampling_params=SamplingParams(max_new_tokens=60, **GREEDY))[0]
    # Feed the model's own greedy continuation back as the prompt: lookup now predicts it exactly.
    prompt = [7, 8, 9] + plain_out.token_ids
    plain2 = Engine("tiny-llama", device="cpu", attention_backend="torch_native", max_total_tokens=4096).generate(
        input_ids=[prompt[:3] + plain_out.token_ids[:40]], sampling_params=SamplingParams(max_new_tokens=20, **GREEDY))
    out = spec.generate(input_ids=[prompt[:3] + plain_out.token_ids[:40]],
                        sampling_params=SamplingParams(max_new_tokens=20, **GREEDY))
    assert out[0].token_ids == plain2[0].token_ids
    assert max(spec.spec_worker.stats.histogram) == 4, spec.spec_worker.stats.histogram


def test_tight_pool_with_preemption_matches_plain(plain):
    prompts = [list(range(3 + i, 30 + i)) for i in range(5)]
    params = SamplingParams(max_new_tokens=24, **GREEDY)
    want = plain.generate(input_ids=prompts, sampling_params=params)
    tight = Engine("tiny-llama", device="cpu", attention_backend="torch_native", max_total_tokens=120, chunked_prefill_size=16,
                   max_running_requests=4, speculative_algorithm="ngram", speculative_num_draft_tokens=5)
    start_rows = tight.runner.req_to_token_pool.num_free
    got = tight.generate(input_ids=prompts, sampling_params=params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert unused_slots(tight) == 120
    assert tight.runner.req_to_token_pool.num_free == start_rows


def test_sampling_is_refused_per_request():
    spec = Engine("tiny-llama", device="cpu", attention_backend="torch_native", max_total_tokens=1024, speculative_algorithm="ngram")
    outs = spec.generate(input_ids=[[5, 6, 7], [5, 6, 7]], sampling_params=[
        SamplingParams(max_new_tokens=4, **GREEDY), SamplingParams(max_new_tokens=4, temperature=0.7)])
    assert outs[0].error is None and len(outs[0].token_ids) == 4
    assert outs[1].finish_reason == "abort"
    assert outs[1].error == ("request 1: --speculative-algorithm ngram supports greedy decoding only; "
                             "expected temperature 0 (or top_k 1), got temperature 0.7")


def test_unknown_algorithm_and_lora_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match=r"--speculative-algorithm 'medusa': unknown; registered algorithms: .*eagle.*ngram"):
        Engine("tiny-llama", device="cpu", attention_backend="torch_native", speculative_algorithm="medusa")
    # ngram and eagle take LoRA adapters; an algorithm that declares it cannot is refused at startup.
    no_lora = SpecAlgorithmSpec(name="no_lora", factory=lambda ctx: None, description="declares no LoRA support")

    class NoLoraPlugin:
        @hookimpl
        def backplane_register_spec_algorithms(self, register):
            register(no_lora)

    with pytest.raises(ValueError, match="--speculative-algorithm no_lora: does not support LoRA adapters"):
        Engine("tiny-llama", device="cpu", attention_backend="torch_native", speculative_algorithm="no_lora",
               lora_paths=[f"a={tmp_path}"], plugins=[NoLoraPlugin()])


def test_drafts_stop_at_the_context_end(plain):  # docs/reliability.md R54
    """Prompts ending a few tokens before the 2048-token context: a request whose drafts would pass
    the end decodes plainly, so greedy output equals plain output up to the last position."""
    spec = Engine("tiny-llama", device="cpu", attention_backend="torch_native", max_total_tokens=4096,
                  max_running_requests=16, speculative_algorithm="ngram", speculative_num_draft_tokens=4)
    motif = [11, 12, 13, 14]
    prompts = [(motif * 600)[:2040], [(7 * i) % 500 + 3 for i in range(2045)], [5, 6, 7]]
    params = [SamplingParams(max_new_tokens=m, **GREEDY) for m in (8, 3, 8)]
    want = plain.generate(input_ids=prompts, sampling_params=params)
    got = spec.generate(input_ids=prompts, sampling_params=params)
    for w, g in zip(want, got):
        assert g.error is None and g.finish_reason == "length"
        assert g.token_ids == w.token_ids
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
    assert max(spec.spec_worker.stats.histogram) > 1  # the motif's drafts were accepted before the end
    assert unused_slots(spec) == 4096
