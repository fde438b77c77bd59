"""Overlap scheduling on the GPU (graphs on): greedy outputs equal --disable-overlap-schedule's."""

from __future__ import annotations

import random

import pytest

from helpers_models import unused_slots

from backplane import Engine, SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_overlap_matches_synchronous_loop_under_graphs(backend):
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 40, 1, 17, 90, 9, 33)]
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in (20, 3, 31, 8, 1, 25, 12)]
    outs = []
    for disable in (False, True):
        engine = Engine("tiny-llama", device="cuda", attention_backend=backend, max_total_tokens=4096,
                        max_running_requests=8, chunked_prefill_size=32, disable_overlap_schedule=disable)
        assert engine.runner.graph_runner is not None
        free = unused_slots(engine)
        outs.append([o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=params)])
        assert unused_slots(engine) == free  # cached prefixes count as unused
    assert outs[0] == outs[1]
    assert [len(t) for t in outs[0]] == [20, 3, 31, 8, 1, 25, 12]


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_decode_steps_never_synchronize_the_stream(backend, monkeypatch):
    """Under overlap the host builds step N+1 while step N runs: building and launching a decode
    step (batch, replay, sampling, the token copy) makes no synchronizing CUDA call. A blocking
    host-to-device copy would wait for the step in flight; torch's sync debug mode raises on one."""
    import torch

    from backplane.engine.scheduler import Scheduler

    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    engine = Engine("tiny-llama", device="cuda", attention_backend=backend, max_total_tokens=4096,
                    max_running_requests=8)
    assert engine.runner.graph_runner is not None and engine.overlap_schedule
    run_decode, steps = Scheduler._run_decode, []

    def strict(self, reqs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            steps.append(len(reqs))
            return run_decode(self, reqs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(Scheduler, "_run_decode", strict)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    outs = engine.generate(input_ids=[[5, 6, 7], [8, 9], [10, 11, 12, 13]], sampling_params=params)
    assert [o.error for o in outs] == [None] * 3 and [len(o.token_ids) for o in outs] == [12] * 3
    assert len(steps) >= 10  # decode steps ran under the check
