"""Each request is checked before anything is scheduled (docs/reliability.md R47-R53).

A bad request in the middle of a `generate` call comes back alone with finish_reason "abort" and a
one-line error naming its input; the good requests around it give the tokens they give alone and
the pool is whole afterwards. Integer numpy arrays and torch tensors are token ids like lists.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from backplane import Engine, SamplingParams
from backplane.cli import main
from helpers_models import unused_slots

GOOD = [[5, 17, 33, 2, 9], [101, 3, 250, 77, 12, 6, 44]]
PARAMS = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
GEN = ["generate", "--model", "tiny-llama", "--device", "cpu", "--max-new-tokens", "2", "--input-ids", "5,6"]


@pytest.fixture(scope="module")
def engine():
    return Engine("tiny-llama", device="cpu", attention_backend="torch_native", max_total_tokens=1024,
                  max_running_requests=8)


@pytest.fixture(scope="module")
def reference(engine) -> list[list[int]]:
    return [engine.generate(input_ids=[ids], sampling_params=PARAMS)[0].token_ids for ids in GOOD]


def _free(engine) -> tuple[int, int]:
    return unused_slots(engine), engine.runner.req_to_token_pool.num_free


def _check_alone(engine, reference, outs, bad_index: int, fragment: str) -> None:
    failed = outs[bad_index]
    assert failed.finish_reason == "abort" and failed.token_ids == [], failed
    assert fragment in failed.error and "\n" not in failed.error, failed.error
    good = [o for i, o in enumerate(outs) if i != bad_index]
    assert [o.token_ids for o in good] == reference and all(o.error is None for o in good)
    assert not engine.scheduler.waiting and not engine.scheduler.running


def _mutated(**changes) -> SamplingParams:
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    for name, value in changes.items():
        setattr(params, name, value)  # after construction: only the check at submission sees it
    return params


MUTATED = [
    ("seed", _mutated(temperature=0.5, seed=2**64), "SamplingParams.seed: expected None or an integer in "
                                                   "[0, 18446744073709551615], got 18446744073709551616"),
    ("top_p", _mutated(top_p=0), "SamplingParams.top_p: expected in (0, 1], got 0"),
    ("temperature", _mutated(temperature=math.nan), "SamplingParams.temperature: expected >= 0 (0 is greedy), got nan"),
    ("max_new_tokens", _mutated(max_new_tokens=0), "SamplingParams.max_new_tokens: expected an integer >= 1, got 0"),
    ("top_k_type", _mutated(top_k="5"), "SamplingParams.top_k: expected an integer >= 1, or 0/-1 for no limit, got '5'"),
    ("not_params", {"temperature": 0}, "sampling_params: expected a SamplingParams, got dict"),
]


@pytest.mark.parametrize("case, bad, fragment", MUTATED, ids=[m[0] for m in MUTATED])
def test_bad_sampling_params_abort_alone(engine, reference, case, bad, fragment):  # R47, R48
    start = _free(engine)
    outs = engine.generate(input_ids=[GOOD[0], [7, 8, 9], GOOD[1]], sampling_params=[PARAMS, bad, PARAMS])
    _check_alone(engine, reference, outs, 1, fragment)
    assert _free(engine) == start


def test_seed_bounds_at_construction():  # R47
    SamplingParams(seed=2**64 - 1)  # the largest seed torch takes
    with pytest.raises(ValueError, match=r"^SamplingParams.seed: expected None or an integer in \[0, "):
        SamplingParams(seed=2**64)
    with pytest.raises(ValueError, match=r"^SamplingParams.temperature: .*got inf$"):
        SamplingParams(temperature=math.inf)


ARRAYS = [
    ("numpy_int64", lambda ids: np.array(ids, dtype=np.int64)),
    ("numpy_uint16", lambda ids: np.array(ids, dtype=np.uint16)),
    ("torch_int32", lambda ids: torch.tensor(ids, dtype=torch.int32)),
    ("tuple_of_numpy_ints", lambda ids: tuple(np.int64(t) for t in ids)),
]


@pytest.mark.parametrize("case, convert", ARRAYS, ids=[a[0] for a in ARRAYS])
def test_integer_arrays_are_token_ids(engine, reference, case, convert):  # R49
    outs = engine.generate(input_ids=[convert(ids) for ids in GOOD], sampling_params=PARAMS)
    assert [o.token_ids for o in outs] == reference
    assert all(type(t) is int for o in outs for t in o.prompt_token_ids)
    one = engine.generate(input_ids=convert(GOOD[0]), sampling_params=PARAMS)  # one request, not a batch
    assert [o.token_ids for o in one] == reference[:1]


def test_two_dimensional_arrays_are_one_request_per_row(engine):  # R49
    rows = [[5, 6, 7], [8, 9, 10]]
    want = [o.token_ids for o in engine.generate(input_ids=rows, sampling_params=PARAMS)]
    for array in (np.array(rows), torch.tensor(rows)):
        assert [o.token_ids for o in engine.generate(input_ids=array, sampling_params=PARAMS)] == want


BAD_IDS = [
    ("float", [5, 2.5, 6], "request ", "input_ids[1]: expected integer token ids, got 2.5 (float) at position 1"),
    ("string", [5, "7"], "request ", "input_ids[1]: expected integer token ids, got '7' (str) at position 1"),
    ("bool", [True, 5], "request ", "input_ids[1]: expected integer token ids, got True (bool) at position 0"),
    ("text", "hello", "request ", "input_ids[1]: expected token ids, got the string 'hello'; pass text as prompts"),
    ("float_array", np.array([1.0, 2.0]), "request ", "input_ids[1]: expected integer token ids, got an array of dtype float64"),
    ("float_tensor", torch.tensor([1.0]), "request ", "input_ids[1]: expected integer token ids, got an array of dtype torch.float32"),
    ("2d_item", torch.tensor([[1, 2]]), "request ", "input_ids[1]: expected a 1-D array of token ids, got shape (1, 2)"),
    ("none", None, "request ", "input_ids[1]: expected a list of token ids, got NoneType None"),
]


@pytest.mark.parametrize("case, bad, prefix, fragment", BAD_IDS, ids=[b[0] for b in BAD_IDS])
def test_malformed_ids_abort_alone(engine, reference, case, bad, prefix, fragment):  # R50
    start = _free(engine)
    outs = engine.generate(input_ids=[GOOD[0], bad, GOOD[1]], sampling_params=PARAMS)
    _check_alone(engine, reference, outs, 1, fragment)
    assert outs[1].error.startswith(prefix)
    assert _free(engine) == start


def test_mixed_text_and_id_prompts(engine, reference):  # R51
    text = "hi there"
    alone = engine.generate(text, PARAMS)[0]
    outs = engine.generate([GOOD[0], text, np.array(GOOD[1])], PARAMS)
    assert [outs[0].token_ids, outs[2].token_ids] == reference
    assert outs[1].token_ids == alone.token_ids and outs[1].prompt_token_ids == alone.prompt_token_ids
    outs = engine.generate([GOOD[0], 42, GOOD[1]], PARAMS)
    _check_alone(engine, reference, outs, 1, "prompts[1]: expected a string or a list of token ids, got int 42")


@pytest.mark.parametrize("kwargs, message", [
    (dict(input_ids="hello"), "generate: input_ids: expected token ids (a list of integers or a list of such "
                              "lists), got the string 'hello'; pass text as prompts"),
    (dict(input_ids=np.zeros((1, 2, 3), dtype=np.int64)), "generate: input_ids: expected a 1-D array (one "
                                                          "request) or a 2-D array (one row per request), got an array of shape (1, 2, 3)"),
    (dict(prompts=7), "generate: prompts: expected a string or a list of token ids or a list of them, got int"),
    (dict(prompts="a", input_ids=[1]), "generate: pass exactly one of prompts or input_ids"),
])
def test_malformed_call_is_one_line(engine, kwargs, message):  # R53
    start = _free(engine)
    with pytest.raises(ValueError) as info:
        engine.generate(sampling_params=PARAMS, **kwargs)
    assert str(info.value) == message
    assert _free(engine) == start and not engine.scheduler.waiting


CLI_FLAGS = [
    (["--top-p", "0"], "--top-p: SamplingParams.top_p: expected in (0, 1], got 0.0"),
    (["--temperature", "nan"], "--temperature: SamplingParams.temperature: expected >= 0 (0 is greedy), got nan"),
    (["--max-new-tokens", "0"], "--max-new-tokens: SamplingParams.max_new_tokens: expected an integer >= 1, got 0"),
    (["--seed", str(2**64)], "--seed (env BACKPLANE_SEED): invalid value '18446744073709551616': Input should be "
                             "less than or equal to 18446744073709551615"),
]


@pytest.mark.parametrize("flags, message", CLI_FLAGS, ids=[f[0][0] for f in CLI_FLAGS])
def test_cli_sampling_error_names_the_flag(flags, message, capsys):  # R52
    assert main([*GEN, *flags]) == 2
    err = capsys.readouterr().err
    assert err == f"backplane: error: {message}\n"
