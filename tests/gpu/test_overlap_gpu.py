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
