"""Overlap scheduling against --disable-overlap-schedule: identical greedy outputs, exact pools.

Overlap launches step N+1 before reading step N's tokens, so stop checks lag one step; these tests
make requests stop mid-batch (stop tokens, stop strings, eos, differing max_new_tokens) next to
requests that keep going, and check every output and both pools against the synchronous loop.
"""

from __future__ import annotations

import random

import pytest
import torch

from backplane import Engine, SamplingParams
from backplane.scheduler.overlap import FutureTokens
from helpers_models import unused_slots
from lora_helpers import make_lora_world

TINY = dict(device="cpu", max_total_tokens=2048, max_running_requests=8)


def prompts_of(lengths, seed=0, vocab=500):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def run_both(model, prompts, params, lora=None, **settings):
    """(overlap outputs, synchronous outputs); each engine's pools must be back to their start (slots the
    prefix cache keeps count as unused)."""
    outs = []
    for disable in (False, True):
        engine = Engine(model, disable_overlap_schedule=disable, **settings)
        assert engine.scheduler.overlap is (not disable)
        rows = engine.runner.req_to_token_pool
        start = (unused_slots(engine), rows.num_free)
        outs.append(engine.generate(input_ids=prompts, sampling_params=params, lora=lora))
        assert (unused_slots(engine), rows.num_free) == start, f"pools not back to their start (overlap {not disable})"
        assert not engine.scheduler.has_work
    return outs


def assert_same(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        assert (x.token_ids, x.finish_reason, x.text) == (y.token_ids, y.finish_reason, y.text), f"request {i}"
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5), f"request {i}"


def test_stops_mid_batch_and_differing_lengths_match():
    prompts = prompts_of([3, 30, 1, 12, 57, 9])
    base = Engine("tiny-llama", **TINY).generate(
        input_ids=prompts, sampling_params=SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))
    # request 1 stops at its 4th token, request 3 at its 2nd; the others run to differing lengths
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in (16, 16, 1, 16, 7, 12)]
    params[1] = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True,
                               stop_token_ids=[base[1].token_ids[3]])
    params[3] = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True,
                               stop_token_ids=[base[3].token_ids[1]])
    on, off = run_both("tiny-llama", prompts, params, **TINY)
    assert_same(on, off)
    assert on[1].finish_reason == "stop" and len(on[1].token_ids) <= 4
    assert [len(on[i].token_ids) for i in (2, 4, 5)] == [1, 7, 12]


def test_eos_and_stop_string_mid_batch_match():
    engine = Engine("tiny-llama", **TINY)
    prompts = prompts_of([5, 8, 2, 20], seed=1)
    base = engine.generate(input_ids=prompts, sampling_params=SamplingParams(max_new_tokens=12, temperature=0.0,
                                                                            ignore_eos=True))
    eos = sorted(engine.scheduler.eos_token_ids)
    assert eos, "the preset must declare an end-of-sequence token"
    # request 0 stops on a stop token, 1 on eos if the model emits one (ignore_eos off), 2 on a stop string
    needle = engine.decode(base[2].token_ids)[2:4]
    params = [SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=[base[0].token_ids[2]]),
              SamplingParams(max_new_tokens=12, temperature=0.0),  # stops at eos, if the model emits it
              SamplingParams(max_new_tokens=12, temperature=0.0, stop=[needle] if needle else None),
              SamplingParams(max_new_tokens=3, temperature=0.0)]
    on, off = run_both("tiny-llama", prompts, params, **TINY)
    assert_same(on, off)
    assert on[0].finish_reason == "stop" and len(on[0].token_ids) <= 3
    if needle:
        assert on[2].finish_reason == "stop"


def test_chunked_prefill_and_preemption_match():
    prompts = [list(range(3, 3 + n)) for n in (70, 45, 90, 20, 33)]
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in (24, 5, 18, 30, 1)]
    on, off = run_both("tiny-llama", prompts, params, device="cpu", max_total_tokens=160,
                       chunked_prefill_size=16, max_running_requests=3)
    assert_same(on, off)
    assert [len(o.token_ids) for o in on] == [24, 5, 18, 30, 1]


def test_lora_mixed_batch_matches(tmp_path):
    world = make_lora_world(tmp_path)
    names = list(world.adapter_dirs)
    prompts = prompts_of([5, 13, 1, 4, 3, 6], seed=2, vocab=300)  # the LoRA test model has 300 tokens
    lora = [names[0], None, names[1], names[2], names[0], None]
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in (6, 3, 8, 1, 5, 7)]
    on, off = run_both(str(world.base_dir), prompts, params, lora=lora, device="cpu", dtype="float32",
                       max_total_tokens=1024, max_running_requests=4, lora_paths=world.lora_paths(),
                       lora_backend="torch_native", max_loras_per_batch=2)
    assert all(o.finish_reason != "abort" for o in on), [o.error for o in on]
    assert_same(on, off)


@pytest.mark.parametrize("reuse", [False, True])
def test_decode_inputs_come_from_placeholders(monkeypatch, reuse):
    """Under overlap every decode step after the first feeds the previous step's tokens from the
    device: a step built from host lists holds placeholders, never the token values, and a step
    that reuses the previous batch (same requests) takes the sampled tokens on the device as they are."""
    seen = []
    resolve = FutureTokens.resolve

    def spy(self, input_ids):
        seen.append(input_ids.tolist())
        return resolve(self, input_ids)

    monkeypatch.setattr(FutureTokens, "resolve", spy)
    engine = Engine("tiny-llama", **TINY)
    state = engine.scheduler.decode_state
    state.reuse = reuse
    engine.generate(input_ids=prompts_of([4, 6]), sampling_params=SamplingParams(max_new_tokens=5, temperature=0.0,
                                                                                  ignore_eos=True))
    assert all(all(t < 0 for t in ids) for ids in seen), seen
    assert len(seen) == state.num_rebuilt and state.num_rebuilt + state.num_reused >= 4
    assert state.num_reused == (3 if reuse else 0)


def test_future_ring_resolves_only_placeholders():
    future = FutureTokens(2, torch.device("cpu"))

    class R:
        def __init__(self, rid):
            self.rid = rid

    a, b = R(0), R(1)
    future.store([a, b], torch.tensor([41, 42]))
    ids = torch.tensor([future.placeholder(b), 7, future.placeholder(a)])
    assert future.resolve(ids).tolist() == [42, 7, 41]
    for _ in range(5):  # the ring wraps without touching the newest placeholders
        future.store([a, b], torch.tensor([1, 2]))
    assert future.resolve(torch.tensor([future.placeholder(a), future.placeholder(b)])).tolist() == [1, 2]
