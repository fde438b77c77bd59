"""Multi-LoRA serving on CPU: mixed batches equal the PEFT-merged transformers model per adapter
(prefill and decode), Triton (interpreted) equals torch_native, eviction and reload change nothing,
the scheduler keeps adapters per batch within the slots, and bad adapters fail clearly."""

import json
import os
import shutil

import pytest
import torch

from backplane import Engine, SamplingParams
from backplane.lora.adapter import AdapterError
from backplane.lora.pool import SlotPool
from helpers_models import relative_error
from lora_helpers import forward_requests, hf_logits, make_lora_world, with_fake_graphs

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 33, 2, 9], list(range(40, 53)), [7], [101, 3, 250, 77], [12, 13, 14], [8, 200, 31]]
MIXED = ["all7_r4", None, "qv_down_r8", "kogu_r2", "all7_r4", None]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return make_lora_world(tmp_path_factory.mktemp("lora"))


def make_engine(world, **kwargs) -> Engine:
    settings = dict(device="cpu", dtype="float32", max_total_tokens=1024, max_running_requests=8,
                    lora_paths=world.lora_paths(), lora_backend="torch_native")
    return Engine(str(world.base_dir), **{**settings, **kwargs})


@pytest.fixture(scope="module")
def engine(world):
    return make_engine(world, max_loras_per_batch=3)


def test_mixed_batch_logits_equal_merged_models(world, engine):
    next_tokens = [11, 29, 3, 250, 64, 1]
    prefill, decode = forward_requests(engine, PROMPTS, MIXED, next_tokens)
    start = 0
    for i, (prompt, name) in enumerate(zip(PROMPTS, MIXED)):
        expected = hf_logits(world.merged[name], prompt + [next_tokens[i]])
        got = prefill[start : start + len(prompt)]
        assert relative_error(got, expected[: len(prompt)]) < 1e-4, f"prefill, request {i} ({name})"
        assert relative_error(decode[i], expected[-1]) < 1e-4, f"decode, request {i} ({name})"
        start += len(prompt)
    # the adapters matter: each merged model differs from the base by far more than the tolerance
    base = hf_logits(world.merged[None], PROMPTS[0])
    assert relative_error(hf_logits(world.merged["all7_r4"], PROMPTS[0]), base) > 1e-2


def hf_greedy_tokens(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf_logits(model, ids)[-1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def merged_greedy(world):
    """The merged transformers model's greedy continuation of each (prompt, adapter) of MIXED."""
    return [hf_greedy_tokens(world.merged[name], prompt, GREEDY.max_new_tokens) for prompt, name in zip(PROMPTS, MIXED)]


def test_generate_mixed_equals_merged_greedy(engine, merged_greedy):
    outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, lora=MIXED)
    assert all(out.error is None for out in outs)
    assert [out.token_ids for out in outs] == merged_greedy
    assert len({tuple(t) for t in merged_greedy[:2]}) == 2  # adapter and base differ on one prompt
    assert engine.backends["lora"]["backend"] == "torch_native"
    assert engine.runner.token_to_kv_pool.num_free == 1024


def test_eviction_and_reload_give_the_same_outputs(world, merged_greedy):
    tight = make_engine(world, max_loras_per_batch=1)
    seen = []
    original = tight.lora_manager.prepare_batch

    def spy(batch, reqs):
        seen.append({r.lora for r in reqs} - {None})
        original(batch, reqs)

    tight.lora_manager.prepare_batch = spy
    tight.scheduler.participants = [tight.lora_manager]
    first = tight.generate(input_ids=PROMPTS, sampling_params=GREEDY, lora=MIXED)
    again = tight.generate(input_ids=PROMPTS[::-1], sampling_params=GREEDY, lora=MIXED[::-1])
    assert [o.token_ids for o in first] == merged_greedy
    assert [o.token_ids for o in again[::-1]] == merged_greedy
    assert max(len(s) for s in seen) == 1, "more distinct adapters in one batch than slots"
    pool = tight.lora_manager.pool
    assert pool.num_evictions > 0 and pool.num_loads > len(world.adapter_dirs)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU run of Triton needs TRITON_INTERPRET=1")
def test_triton_equals_torch_native(world, engine):
    prompts, adapters = PROMPTS[:4], MIXED[:4]
    triton_engine = make_engine(world, max_loras_per_batch=3, lora_backend="triton", max_running_requests=4)
    assert triton_engine.backends["lora"]["backend"] == "triton"
    params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    got = triton_engine.generate(input_ids=prompts, sampling_params=params, lora=adapters)
    want = engine.generate(input_ids=prompts, sampling_params=params, lora=adapters)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-4, rtol=1e-4)


def test_unknown_adapter_fails_alone(engine):
    outs = engine.generate(input_ids=PROMPTS[:3], sampling_params=GREEDY, lora=["all7_r4", "nope", None])
    assert outs[0].error is None and outs[2].error is None
    assert "unknown LoRA adapter 'nope'" in outs[1].error and "loaded: all7_r4, kogu_r2, qv_down_r8" in outs[1].error


def test_slot_pool_lru_spares_running_adapters():
    pool = SlotPool(2)
    assert pool.assign(["a", "b"]) == [("a", 1), ("b", 2)]
    assert pool.assign(["a"]) == []  # b is now the least recently used
    assert pool.assign(["c"], pinned=["b"]) == [("c", 1)]  # a is evicted: b is running
    assert pool.slots_for(["b", None, "c"]) == [2, 0, 1]
    assert pool.assign(["d"]) == [("d", 2)]  # b: least recently used, nothing pinned
    with pytest.raises(RuntimeError, match="needs 3 adapters but there are 2 slots"):
        pool.assign(["x", "y", "z"])


def copy_adapter(world, tmp_path, name="all7_r4"):
    target = tmp_path / name
    shutil.copytree(world.adapter_dirs[name], target)
    return target


def edit_config(path, **changes):
    config = json.loads((path / "adapter_config.json").read_text())
    config.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(config))


def test_bad_adapters_fail_at_engine_construction(world, tmp_path):
    cases = []
    missing = copy_adapter(world, tmp_path / "m")
    (missing / "adapter_model.safetensors").unlink()
    cases.append((missing, {}, f"expected file {missing / 'adapter_model.safetensors'} to exist"))
    cases.append((tmp_path / "nowhere", {}, "expected a PEFT adapter directory"))
    cases.append((world.adapter_dirs["qv_down_r8"], dict(max_lora_rank=4),
                  "rank r=8 is above --max-lora-rank 4; raise --max-lora-rank to at least 8"))
    lm_head = copy_adapter(world, tmp_path / "l")
    edit_config(lm_head, target_modules=["q_proj", "lm_head"])
    cases.append((lm_head, {}, "target module 'lm_head' is not a projection"))
    dora = copy_adapter(world, tmp_path / "d")
    edit_config(dora, use_dora=True)
    cases.append((dora, {}, "use_dora=True is not supported"))
    for path, kwargs, message in cases:
        with pytest.raises(AdapterError, match="LoRA adapter 'bad'") as err:
            make_engine(world, lora_paths=[f"bad={path}"], **kwargs)
        assert message in str(err.value)


def test_non_float_and_misshaped_weights_are_refused(world, tmp_path):
    from safetensors.torch import load_file, save_file

    for label, change, message in [
        ("int", lambda t: t.to(torch.int8), "expected floating-point lora_A weights, got torch.int8"),
        ("shape", lambda t: t[:, :-1].contiguous(), "expected lora_A [4, 64] and lora_B"),
    ]:
        path = copy_adapter(world, tmp_path / label)
        tensors = load_file(str(path / "adapter_model.safetensors"))
        key = next(k for k in tensors if k.endswith("layers.1.self_attn.k_proj.lora_A.weight"))
        tensors[key] = change(tensors[key])
        save_file(tensors, str(path / "adapter_model.safetensors"))
        with pytest.raises(AdapterError, match="layer 1 k_proj") as err:
            make_engine(world, lora_paths=[f"bad={path}"])
        assert message in str(err.value)


@pytest.mark.parametrize("backend", ["torch_native", "triton"])
def test_padded_graph_replay_path_equals_merged_models(world, backend):
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU run of Triton needs TRITON_INTERPRET=1")
    engine = make_engine(world, max_loras_per_batch=3, lora_backend=backend, cuda_graph_bs=[2, 8])
    graphs = with_fake_graphs(engine)
    next_tokens = [11, 29, 3, 250, 64, 1]
    _, decode = forward_requests(engine, PROMPTS, MIXED, next_tokens)
    assert [(k.batch_size, dict(k.extras)["lora"]) for k in graphs.replayed] == [(8, True)]
    for i, (prompt, name) in enumerate(zip(PROMPTS, MIXED)):
        expected = hf_logits(world.merged[name], prompt + [next_tokens[i]])[-1]
        assert relative_error(decode[i], expected) < 1e-4, f"request {i} ({name})"
    engine.generate(input_ids=PROMPTS[:2], sampling_params=GREEDY, lora=[None, None])
    assert (2, False) in [(k.batch_size, dict(k.extras)["lora"]) for k in graphs.replayed]


def test_generate_through_graph_path_with_eviction(world, merged_greedy):
    engine = make_engine(world, max_loras_per_batch=2, cuda_graph_bs=[1, 2, 4, 8])
    graphs = with_fake_graphs(engine)
    outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, lora=MIXED)
    assert [o.token_ids for o in outs] == merged_greedy
    assert {dict(k.extras)["lora"] for k in graphs.replayed} == {True}
    assert engine.lora_manager.pool.num_evictions > 0
