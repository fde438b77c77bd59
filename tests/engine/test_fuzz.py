"""Fuzzing bad input with hypothesis (docs/reliability.md R66-R68): config.json fields, SamplingParams
fields and prompt types. Whatever is drawn, the result is either accepted or one line naming the
input; a generate call never raises a raw exception, every good request completes as when run
alone and the KV pool and request rows are whole afterwards.

The config property reads config.json only (no model is built); the engine property shares one
tiny engine and keeps requests to a few tokens, so the whole file runs in a few seconds.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backplane import Engine, SamplingParams
from backplane.models.loader import load_hf_config
from backplane.models.weights import llama_checkpoint_shapes
from helpers_models import unused_slots

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
          "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
          "vocab_size": 300, "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
          "tie_word_embeddings": False, "head_dim": 16}
GOOD = [5, 17, 33, 2, 9]
PARAMS = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)

# Values of every JSON type, with the edge cases of each: zero, negatives, huge, NaN, infinity.
ANY_VALUE = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 70), st.sampled_from([0, -1, 2**31, 2**64]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6), st.lists(st.integers(-2, 5), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FAST
@given(changes=st.dictionaries(st.sampled_from(sorted(CONFIG)), ANY_VALUE, min_size=1, max_size=3))
def test_fuzzed_config_is_accepted_or_one_line(tmp_path_factory, changes):  # R66
    path = tmp_path_factory.mktemp("cfg")
    raw = {**CONFIG, **changes}
    (path / "config.json").write_text(json.dumps(raw))
    try:
        config = load_hf_config(path)
    except ValueError as err:
        message = str(err)
        assert "\n" not in message and message.startswith(f"model config '{path}/config.json': "), message
        return
    # Accepted: the sizes the model is built from are usable as they are.
    for name in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "max_position_embeddings"):
        value = getattr(config, name)
        assert isinstance(value, int) and not isinstance(value, bool) and value >= 1, (name, value)
    assert config.num_attention_heads % (config.num_key_value_heads or config.num_attention_heads) == 0
    archs = config.architectures  # None: get_model_spec refuses it with one line
    assert archs is None or (isinstance(archs, list) and all(isinstance(a, str) for a in archs)), archs
    if max(config.hidden_size, config.vocab_size, config.num_hidden_layers) <= 300:
        llama_checkpoint_shapes(config, qkv_bias=False, qk_norm=False)


SAMPLING_FIELDS = {
    "max_new_tokens": st.one_of(st.integers(-2, 4), ANY_VALUE),
    "temperature": st.one_of(st.floats(0, 2), ANY_VALUE),
    "top_k": st.one_of(st.integers(-2, 5), ANY_VALUE),
    "top_p": st.one_of(st.floats(0, 1), ANY_VALUE),
    "min_p": st.one_of(st.floats(0, 1), ANY_VALUE),
    "seed": st.one_of(st.none(), st.integers(-1, 2**64 + 1), ANY_VALUE),
    "stop": st.one_of(st.lists(st.text(max_size=2), max_size=2), ANY_VALUE),
    "stop_token_ids": st.one_of(st.lists(st.integers(-1, 600), max_size=2), ANY_VALUE),
    "ignore_eos": st.one_of(st.booleans(), ANY_VALUE),
}


@settings(max_examples=200, deadline=None)
@given(fields=st.fixed_dictionaries({}, optional=SAMPLING_FIELDS))
def test_fuzzed_sampling_params_construct_or_one_line(fields):  # R67
    try:
        params = SamplingParams(**fields)
    except ValueError as err:
        message = str(err)
        assert "\n" not in message and message.startswith("SamplingParams."), message
        assert message.split(":")[0].removeprefix("SamplingParams.") in fields
        return
    assert params.problem() is None


def _ids(draw_list) -> st.SearchStrategy:
    return st.lists(draw_list, min_size=0, max_size=6)


PROMPTS = st.one_of(
    st.text(max_size=8),
    _ids(st.integers(0, 511)),
    _ids(st.integers(-3, 700)),
    _ids(st.one_of(st.integers(0, 511), st.floats(), st.text(max_size=2), st.booleans(), st.none())),
    _ids(st.integers(0, 511)).map(lambda ids: np.array(ids, dtype=np.int64)),
    _ids(st.integers(0, 511)).map(lambda ids: np.array(ids, dtype=np.float32)),
    _ids(st.integers(0, 511)).map(lambda ids: torch.tensor(ids, dtype=torch.int32)),
    _ids(st.integers(0, 511)).map(lambda ids: torch.tensor([ids, ids])),
    st.sampled_from([None, 7, 2.5, {"ids": [1]}, [[1, 2]]]),
)


@pytest.fixture(scope="module")
def engine():
    return Engine("tiny-llama", device="cpu", attention_backend="torch_native", max_total_tokens=512,
                  max_running_requests=8)


@pytest.fixture(scope="module")
def good_tokens(engine) -> list[int]:
    return engine.generate(input_ids=[GOOD], sampling_params=PARAMS)[0].token_ids


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompts=st.lists(PROMPTS, min_size=1, max_size=4),
       mutations=st.lists(st.fixed_dictionaries({}, optional=SAMPLING_FIELDS), min_size=1, max_size=4))
def test_fuzzed_requests_fail_alone(engine, good_tokens, prompts, mutations):  # R68
    start = unused_slots(engine), engine.runner.req_to_token_pool.num_free
    params = [PARAMS]
    for i in range(len(prompts)):
        p = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
        for name, value in mutations[i % len(mutations)].items():
            setattr(p, name, value)  # after construction: checked at submission
        params.append(p)
    outs = engine.generate([GOOD, *prompts], params)
    assert len(outs) == 1 + len(prompts)
    assert outs[0].error is None and outs[0].token_ids == good_tokens
    for out in outs[1:]:
        assert out.finish_reason in ("stop", "length", "abort")
        if out.finish_reason == "abort":
            assert out.error and "\n" not in out.error and out.error.startswith("request "), out.error
        else:
            assert out.error is None and all(math.isfinite(lp) for lp in out.logprobs)
    assert (unused_slots(engine), engine.runner.req_to_token_pool.num_free) == start
    assert not engine.scheduler.running and not engine.scheduler.waiting
