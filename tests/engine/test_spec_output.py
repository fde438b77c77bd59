"""`generate` reports each request's speculative acceptance (and nothing without speculation)."""

from __future__ import annotations

from backplane import Engine, SamplingParams
from backplane.cli import main

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
REPETITIVE = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]]


def test_outputs_carry_the_acceptance_under_ngram():
    engine = Engine("tiny-llama", device="cpu", speculative_algorithm="ngram", speculative_num_draft_tokens=4)
    out = engine.generate(input_ids=REPETITIVE, sampling_params=GREEDY)[0]
    spec = out.speculative
    assert spec is not None and spec["tokens"] >= len(out.token_ids) - 1 and spec["steps"] >= 1
    assert spec["mean_acceptance_length"] == spec["tokens"] / spec["steps"]
    assert out.to_dict()["speculative"] == spec
    plain = Engine("tiny-llama", device="cpu").generate(input_ids=REPETITIVE, sampling_params=GREEDY)[0]
    assert plain.speculative is None and "speculative" not in plain.to_dict()
    assert plain.token_ids == out.token_ids


def test_generate_prints_the_mean_acceptance_length(capsys):
    assert main(["generate", "--model", "tiny-llama", "--device", "cpu", "--max-new-tokens", "8",
                 "--speculative-algorithm", "ngram", "--input-ids", "5,6,7,8,5,6,7,8,5,6,7"]) == 0
    assert "speculative decoding (ngram):" in capsys.readouterr().out
