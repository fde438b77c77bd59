"""DecodeState: a decode step of the same requests as the last one advances that batch in place.

The persistent path must give the same batches, outputs, log-probabilities and pools as the batch
built from host lists every step (`DecodeState(reuse=False)`), across every way the running set
changes: requests finishing, new ones admitted, preemption, chunked prefill between decode steps,
overlap on and off, LoRA batches, seeded sampling. And a steady-state step must build no tensor
from a Python list.
"""

from __future__ import annotations

import random

import pytest
import torch

from backplane import Engine, SamplingParams
from backplane.scheduler.request import Req
from backplane.contracts.batch import ForwardMode
from lora_helpers import make_lora_world

TINY = dict(device="cpu", max_total_tokens=2048, max_running_requests=4)
FIELDS = ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens", "seq_lens_cpu")


def prompts_of(lengths, seed=0):
    """Random prompts inside both models' vocabularies (the LoRA test model has 300 tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(n)] for n in lengths]


def record_decode_batches(engine) -> list[tuple]:
    """Spy on the runner: each decode step's batch fields as (values, dtype, device type), in step
    order; a prefill of one-token chunks, which reaches the runner as DECODE too, is not a step."""
    seen, forward, prefilling = [], engine.runner.forward, [False]
    launcher = engine.scheduler.launcher
    forward_prefill = launcher.forward_prefill

    def in_prefill(*args, **options):
        prefilling[0] = True
        try:
            return forward_prefill(*args, **options)
        finally:
            prefilling[0] = False

    def spy(batch):
        if batch.forward_mode is ForwardMode.DECODE and not prefilling[0]:
            seen.append(tuple((getattr(batch, f).tolist(), getattr(batch, f).dtype, getattr(batch, f).device.type)
                              for f in FIELDS))
        return forward(batch)

    engine.runner.forward = spy
    launcher.forward_prefill = in_prefill
    return seen


def pools_of(engine) -> dict:
    kv, rows = engine.runner.token_to_kv_pool, engine.runner.req_to_token_pool
    return {"free_slots": kv._free[:kv.num_free].tolist(), "is_free": kv._is_free.tolist(),
            "free_rows": list(rows._free_rows), "req_to_token": rows.req_to_token.clone(),
            "k": [k.clone() for k in kv.k_buffers], "v": [v.clone() for v in kv.v_buffers]}


def run_both(model, prompts, params, lora=None, **settings):
    """Generate with the persistent decode state and with the list-built one; return both runs'
    (outputs, decode batches, pools, state)."""
    runs = []
    for reuse in (True, False):
        engine = Engine(model, **settings)
        state = engine.scheduler.decode_state
        state.reuse = reuse
        batches = record_decode_batches(engine)
        outs = engine.generate(input_ids=prompts, sampling_params=params, lora=lora)
        assert not engine.scheduler.has_work
        runs.append((outs, batches, pools_of(engine), state))
    return runs


def assert_identical(reused, built):
    (outs_a, batches_a, pools_a, state), (outs_b, batches_b, pools_b, reference) = reused, built
    for i, (x, y) in enumerate(zip(outs_a, outs_b, strict=True)):
        assert x.finish_reason != "abort", f"request {i}: {x.error}"
        assert (x.token_ids, x.finish_reason, x.logprobs) == (y.token_ids, y.finish_reason, y.logprobs), f"request {i}"
    assert len(batches_a) == len(batches_b)
    for step, (a, b) in enumerate(zip(batches_a, batches_b)):
        assert a == b, f"decode step {step}: fields {FIELDS} differ"
    for name in ("free_slots", "is_free", "free_rows"):
        assert pools_a[name] == pools_b[name], name
    assert torch.equal(pools_a["req_to_token"], pools_b["req_to_token"])
    assert all(map(torch.equal, pools_a["k"] + pools_a["v"], pools_b["k"] + pools_b["v"]))
    assert reference.num_reused == 0 and reference.num_rebuilt == len(batches_b)
    assert state.num_reused > 0 and state.num_rebuilt > 1, (state.num_reused, state.num_rebuilt)
    assert state.num_reused + state.num_rebuilt == len(batches_a)


@pytest.mark.parametrize("disable_overlap", [False, True], ids=["overlap", "no-overlap"])
def test_finishing_and_admitted_requests_match_list_built(disable_overlap):
    prompts = prompts_of([3, 30, 1, 12, 57, 9, 5, 21])
    lengths = (16, 4, 1, 9, 7, 12, 20, 3)
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    params[3] = SamplingParams(max_new_tokens=9, temperature=0.8, top_k=20, seed=5, ignore_eos=True)
    params[5] = SamplingParams(max_new_tokens=12, temperature=0.7, top_p=0.9, seed=11, ignore_eos=True)
    reused, built = run_both("tiny-llama", prompts, params, disable_overlap_schedule=disable_overlap, **TINY)
    assert_identical(reused, built)
    assert [len(o.token_ids) for o in reused[0]] == list(lengths)


@pytest.mark.parametrize("disable_overlap", [False, True], ids=["overlap", "no-overlap"])
def test_chunked_prefill_and_preemption_match_list_built(disable_overlap):
    prompts = [list(range(3, 3 + n)) for n in (70, 45, 90, 20, 33)]
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in (24, 5, 18, 30, 1)]
    reused, built = run_both("tiny-llama", prompts, params, device="cpu", max_total_tokens=160,
                             chunked_prefill_size=16, max_running_requests=3,
                             disable_overlap_schedule=disable_overlap)
    assert_identical(reused, built)
    assert [len(o.token_ids) for o in reused[0]] == [24, 5, 18, 30, 1]


@pytest.mark.parametrize("disable_overlap", [False, True], ids=["overlap", "no-overlap"])
def test_lora_batches_match_list_built(tmp_path, disable_overlap):
    world = make_lora_world(tmp_path)
    names = list(world.adapter_dirs)
    prompts = prompts_of([5, 13, 1, 4, 3, 6], seed=2)
    lora = [names[0], None, names[1], names[2], names[0], None]
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in (6, 3, 8, 1, 5, 7)]
    reused, built = run_both(str(world.base_dir), prompts, params, lora=lora, device="cpu", dtype="float32",
                             max_total_tokens=1024, max_running_requests=4, lora_paths=world.lora_paths(),
                             lora_backend="torch_native", max_loras_per_batch=2,
                             disable_overlap_schedule=disable_overlap)
    assert_identical(reused, built)


def test_row_change_under_same_requests_rebuilds():
    """A request preempted and re-prefilled into another row between two decode steps of the same
    requests must not reuse the old rows."""
    engine = Engine("tiny-llama", disable_overlap_schedule=True, **TINY)
    sched, state = engine.scheduler, engine.scheduler.decode_state
    for rid, prompt in enumerate(prompts_of([4, 6])):
        sched.add(Req(rid, prompt, SamplingParams(max_new_tokens=50, temperature=0.0, ignore_eos=True)))
    for _ in range(3):
        sched.step()
    rebuilt, reused = state.num_rebuilt, state.num_reused
    victim = sched.running[-1]
    old_row, num_cached = victim.row, victim.num_cached
    sched.queues.preempt(victim, keep=False)
    taken = engine.runner.req_to_token_pool.alloc()  # the freed row: the victim comes back in another
    sched.step()  # re-prefill (no token sampled: the request has output already)
    engine.runner.req_to_token_pool.free(taken)
    assert [r.rid for r in sched.running] == [0, 1] and victim.num_cached == num_cached
    assert victim.row not in (None, old_row)
    sched.step()
    assert (state.num_rebuilt, state.num_reused) == (rebuilt + 1, reused)
    sched.step()
    assert (state.num_rebuilt, state.num_reused) == (rebuilt + 1, reused + 1)


@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
@pytest.mark.parametrize("disable_overlap", [False, True], ids=["overlap", "no-overlap"])
def test_steady_decode_step_builds_no_tensor_from_a_list(monkeypatch, tmp_path, lora, disable_overlap):
    settings = dict(TINY, disable_overlap_schedule=disable_overlap)
    model, adapters = "tiny-llama", [None] * 3
    if lora:
        world = make_lora_world(tmp_path)
        names = list(world.adapter_dirs)
        model, adapters = str(world.base_dir), [names[0], None, names[1]]
        settings.update(dtype="float32", lora_paths=world.lora_paths(), lora_backend="torch_native",
                        max_loras_per_batch=2)
    engine = Engine(model, **settings)
    sched, state = engine.scheduler, engine.scheduler.decode_state
    for rid, (prompt, name) in enumerate(zip(prompts_of([4, 9, 2]), adapters)):
        params = SamplingParams(max_new_tokens=40, temperature=0.0 if rid != 1 else 0.9, seed=3, ignore_eos=True)
        sched.add(Req(rid, prompt, params, lora=name))
    for _ in range(3):  # prefill, then the first decode step builds the state
        sched.step()
    calls, real = [], torch.tensor

    def counting(data, *args, **kwargs):
        if isinstance(data, (list, tuple)):
            calls.append(len(data))
        return real(data, *args, **kwargs)

    monkeypatch.setattr(torch, "tensor", counting)
    reused = state.num_reused
    for _ in range(5):
        assert not sched.step()
    assert state.num_reused == reused + 5
    assert calls == [], f"torch.tensor(list) calls in steady decode steps: lengths {calls}"
