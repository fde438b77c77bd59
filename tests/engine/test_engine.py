"""The engine end to end on CPU: equal to transformers, batching, sampling, stopping, pools, bad input."""

from __future__ import annotations

import json
import random

import pytest
import torch

from backplane import Engine, SamplingParams
from backplane.cli import main
from helpers_models import make_hf_model, tiny_hf_config, unused_slots

ARCHS = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """arch -> (directory of a saved tiny random model, the transformers model)."""
    out = {}
    for i, arch in enumerate(ARCHS):
        model = make_hf_model(tiny_hf_config(arch), seed=i)
        path = tmp_path_factory.mktemp(arch)
        model.save_pretrained(path, safe_serialization=True)
        out[arch] = (path, model)
    return out


def hf_generate(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0)
    return out[0, len(prompt):].tolist()


PROMPTS = [[5, 17, 33, 2, 9], list(range(40, 61)), [7], [101, 3, 250, 77, 12, 6, 44, 199, 31]]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_transformers_generate(arch, hf_dirs):
    path, hf_model = hf_dirs[arch]
    engine = Engine(str(path), device="cpu", dtype="float32", max_total_tokens=1024)
    outs = engine.generate(input_ids=PROMPTS, sampling_params=SamplingParams(max_new_tokens=12, **GREEDY))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_generate(hf_model, prompt, 12)
        assert out.finish_reason == "length" and len(out.logprobs) == 12


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_cli_json_equals_transformers(arch, hf_dirs, capsys):
    path, hf_model = hf_dirs[arch]
    argv = ["generate", "--model", str(path), "--device", "cpu", "--dtype", "float32", "--json",
            "--input-ids", "5,17,33,2,9", "--input-ids", "7", "--max-new-tokens", "8", "--ignore-eos"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [o["token_ids"] for o in doc["outputs"]] == [hf_generate(hf_model, p, 8) for p in ([5, 17, 33, 2, 9], [7])]
    assert doc["backends"]["attention"]["decode"]["backend"] == "torch_native"


@pytest.fixture(scope="module")
def engine():
    return Engine("tiny-llama", device="cpu", max_total_tokens=4096, max_running_requests=16)


def test_batched_equals_unbatched(engine):
    prompts = [[random.Random(i).randrange(3, 500) for _ in range(n)] for i, n in enumerate([3, 30, 1, 12, 57])]
    params = SamplingParams(max_new_tokens=10, **GREEDY)
    together = engine.generate(input_ids=prompts, sampling_params=params)
    for prompt, out in zip(prompts, together):
        assert engine.generate(input_ids=[prompt], sampling_params=params)[0].token_ids == out.token_ids


def test_chunked_prefill_and_preemption_do_not_change_greedy_output():
    prompts = [list(range(3, 3 + n)) for n in (70, 45, 90, 20)]
    params = SamplingParams(max_new_tokens=24, **GREEDY)
    reference = Engine("tiny-llama", device="cpu", max_total_tokens=4096).generate(input_ids=prompts, sampling_params=params)
    tight = Engine("tiny-llama", device="cpu", max_total_tokens=160, chunked_prefill_size=16, max_running_requests=3)
    outs = tight.generate(input_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    assert unused_slots(tight) == 160


def test_same_seed_same_tokens(engine):
    params = [SamplingParams(max_new_tokens=12, temperature=1.0, seed=s) for s in (1, 1, 2)]
    prompt = [10, 20, 30]
    outs = engine.generate(input_ids=[prompt] * 3, sampling_params=params)
    assert outs[0].token_ids == outs[1].token_ids != outs[2].token_ids
    alone = engine.generate(input_ids=[prompt], sampling_params=params[0])[0]
    assert alone.token_ids == outs[0].token_ids


def test_stop_token_and_stop_string(engine):
    base = engine.generate(input_ids=[[9, 8, 7]], sampling_params=SamplingParams(max_new_tokens=20, **GREEDY))[0]
    stop_at = base.token_ids[5]
    cut = base.token_ids.index(stop_at)
    out = engine.generate(input_ids=[[9, 8, 7]], sampling_params=SamplingParams(
        max_new_tokens=20, stop_token_ids=[stop_at], **GREEDY))[0]
    assert out.token_ids == base.token_ids[:cut + 1] and out.finish_reason == "stop"

    text = engine.generate(prompts=["abc"], sampling_params=SamplingParams(max_new_tokens=20, **GREEDY))[0].text
    needle = text[3:5]
    assert needle, "the tiny model must produce some text"
    out = engine.generate(prompts=["abc"], sampling_params=SamplingParams(max_new_tokens=20, stop=[needle], **GREEDY))[0]
    assert out.finish_reason == "stop" and out.text == text[:text.find(needle)]
    assert len(out.token_ids) < 20


def test_pool_accounting_under_a_random_workload():
    engine = Engine("tiny-llama", device="cpu", max_total_tokens=200, max_running_requests=8, chunked_prefill_size=48)
    start_free, start_rows = unused_slots(engine), engine.runner.req_to_token_pool.num_free
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 60))] for _ in range(300)]
    params = [SamplingParams(max_new_tokens=rng.randint(1, 16), temperature=rng.choice([0.0, 0.8]), seed=i)
              for i in range(300)]
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert len(outs) == 300
    assert all(o.error is None and len(o.token_ids) >= 1 for o in outs)
    assert all(len(o.token_ids) == p.max_new_tokens for o, p in zip(outs, params) if o.finish_reason == "length")
    assert unused_slots(engine) == start_free
    assert engine.runner.req_to_token_pool.num_free == start_rows


def test_bad_requests_fail_alone(engine):
    free = unused_slots(engine)
    good = [5, 6, 7]
    long_prompt = list(range(3, 3 + 2100))
    outs = engine.generate(input_ids=[good, [], long_prompt, good, list(range(3, 4000))],
                           sampling_params=SamplingParams(max_new_tokens=4, **GREEDY))
    assert outs[0].error is None and outs[3].error is None and outs[0].token_ids == outs[3].token_ids
    assert "empty prompt" in outs[1].error and outs[1].finish_reason == "abort"
    assert "exceeds the context length 2048" in outs[2].error
    assert "2100 tokens" in outs[2].error
    assert unused_slots(engine) == free


def test_request_larger_than_the_pool_fails_alone():
    engine = Engine("tiny-llama", device="cpu", max_total_tokens=64)
    outs = engine.generate(input_ids=[[5, 6], list(range(3, 80))], sampling_params=SamplingParams(max_new_tokens=4, **GREEDY))
    assert outs[0].error is None
    assert outs[1].error == ("request 1: prompt of 77 tokens + max_new_tokens 4 needs 81 KV slots but the pool "
                             "holds 64; raise --max-total-tokens")


def test_unknown_adapter_fails_alone(engine):
    outs = engine.generate(input_ids=[[5, 6], [7, 8]], lora=[None, "nope"], sampling_params=SamplingParams(max_new_tokens=3))
    assert outs[0].error is None
    assert "unknown LoRA adapter 'nope'" in outs[1].error


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1.0), "SamplingParams.temperature: expected >= 0 (0 is greedy), got -1.0"),
    (dict(top_p=0.0), "SamplingParams.top_p: expected in (0, 1], got 0.0"),
    (dict(top_k=-5), "SamplingParams.top_k: expected an integer >= 1, or 0/-1 for no limit, got -5"),
    (dict(min_p=1.5), "SamplingParams.min_p: expected in [0, 1], got 1.5"),
    (dict(max_new_tokens=0), "SamplingParams.max_new_tokens: expected an integer >= 1, got 0"),
    (dict(stop=[""]), "SamplingParams.stop: expected non-empty strings, got ['']"),
])
def test_invalid_sampling_params(kwargs, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert str(err.value) == message


def test_unknown_preset_is_a_clear_error():
    with pytest.raises(ValueError, match="--model 'llama-9b': expected a local Hugging Face model directory or a preset name; presets: "):
        Engine("llama-9b", device="cpu")


def test_cli_bad_input_ids_exit_2(capsys):
    assert main(["generate", "--input-ids", "1,x"]) == 2
    assert "expected comma-separated integers" in capsys.readouterr().err


def test_cli_text_output_names_the_plugins(capsys):
    assert main(["generate", "--model", "tiny-llama", "--device", "cpu", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "attention prefill=torch_native (plugin attention.builtin)" in out and "tokens/s" in out
