"""Stop strings are bounded and matched on the text's tail (issue 42, bug 5), and sampling settings
that are valid but underflow in float32 sample as their limit does."""

from __future__ import annotations

import random

import pytest

from backplane import Engine, SamplingParams
from backplane.models.byte_tokenizer import ByteTokenizer
from backplane.scheduler.request import Req
from backplane.scheduler.sampling_params import MAX_STOP_LENGTH, MAX_STOP_STRINGS
from backplane.scheduler.stopping import check_stop

TOK = ByteTokenizer()


def decode(ids):
    return TOK.decode(ids, skip_special_tokens=True)


def test_stop_strings_are_bounded_in_one_line():
    with pytest.raises(ValueError, match=rf"SamplingParams.stop: expected at most {MAX_STOP_STRINGS} strings "
                                         r".* \(60000 items\)$"):
        SamplingParams(stop=["x"] * 60000)
    with pytest.raises(ValueError, match=rf"of at most {MAX_STOP_LENGTH} characters each"):
        SamplingParams(stop=["y" * (MAX_STOP_LENGTH + 1)])
    SamplingParams(stop=["z" * MAX_STOP_LENGTH] * MAX_STOP_STRINGS)  # the bounds themselves are fine


def run_stop(ids, stops, calls=None):
    """Feed `ids` one token at a time through check_stop; (tokens kept, text) at the stop."""
    seen = (lambda w: calls.append(len(w)) or decode(w)) if calls is not None else decode
    req = Req(0, [1], SamplingParams(max_new_tokens=len(ids) + 1, stop=stops, ignore_eos=True))
    for token in ids:
        req.output_ids.append(token)
        if check_stop(req, set(), seen):
            return len(req.output_ids), req.text
    return len(req.output_ids), None


def naive(ids, stops):
    """The reference: decode everything after every token, cut at the first stop string found."""
    for n in range(1, len(ids) + 1):
        text = decode(ids[:n])
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            return n, text[:min(hits)]
    return len(ids), None


@pytest.mark.parametrize("seed", range(40))
def test_tail_matching_equals_matching_the_whole_text(seed):
    rng = random.Random(seed)
    words = ["ab", "é", "✓", "c", "  ", "stop", "\n"]
    text = "".join(rng.choice(words) for _ in range(60))
    ids = TOK.encode(text, add_special_tokens=False)
    ids = [t if rng.random() > 0.1 else 300 for t in ids]  # ids without text (past the byte range)
    stops = [rng.choice([text[i:i + rng.randint(1, 8)] for i in range(0, len(text), 7)]) for _ in range(3)]
    stops = [s for s in stops if s] or ["stop"]
    assert run_stop(ids, stops) == naive(ids, stops)


def test_a_step_decodes_a_short_tail_whatever_the_number_of_stop_strings():
    ids = TOK.encode("lorem ipsum dolor sit amet " * 20, add_special_tokens=False)
    for stops in (["zz"], [f"q{i:03d}" for i in range(MAX_STOP_STRINGS)]):
        calls = []
        assert run_stop(ids, stops, calls) == (len(ids), None)
        assert max(calls) <= 3 * max(map(len, stops)) + 12, f"decoded {max(calls)} tokens of {len(ids)} in one step"


@pytest.fixture(scope="module")
def engine():
    return Engine("tiny-llama", device="cpu", max_total_tokens=1024)


@pytest.mark.parametrize("settings", [dict(top_p=1e-50), dict(top_p=1e-300, top_k=5), dict(temperature=1e-300),
                                      dict(temperature=1e-46, top_p=1e-60, min_p=1e-300)])
def test_underflowing_settings_sample_their_limit_the_most_likely_token(engine, settings):
    prompt = [[1, 72, 105, 9], [1, 30, 31]]
    greedy = engine.generate(input_ids=prompt, sampling_params=SamplingParams(max_new_tokens=6, temperature=0))
    outs = engine.generate(input_ids=prompt, sampling_params=SamplingParams(max_new_tokens=6, seed=3, **settings))
    assert [o.token_ids for o in outs] == [g.token_ids for g in greedy]
