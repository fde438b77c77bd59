"""Graph replay equals eager for every captured size, with padding, over a random workload (GPU)."""

from __future__ import annotations

import random

import pytest
import torch

from backplane import Engine, SamplingParams
from backplane.executor.graph_runner import GraphRunner
from backplane.executor.graph_sizes import padded_size
from backplane.contracts.model import ModelOutput
from helpers_models import unused_slots

pytestmark = pytest.mark.gpu

BACKENDS = ["triton", "flashinfer"]


def _engine(backend: str, **kw) -> Engine:
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    return Engine("tiny-llama", device="cuda", dtype="bfloat16", attention_backend=backend,
                  max_total_tokens=40000, max_running_requests=48, cuda_graph_max_bs=48, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_replay_equals_eager_for_every_captured_size(backend):
    engine = _engine(backend)
    runner = engine.runner
    graphs = runner.graph_runner
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8, 16, 24, 32, 40, 47, 48]
    replayed, worst = set(), 0.0

    @torch.inference_mode()
    def checked_forward(batch):
        if not graphs.can_run(batch):
            return runner.forward_eager(batch)
        graph_logits = graphs.replay(batch).logits.clone()
        eager_logits = runner.forward_eager(batch).logits
        nonlocal worst
        worst = max(worst, float((graph_logits - eager_logits).abs().max()))
        torch.testing.assert_close(graph_logits, eager_logits, atol=3e-2, rtol=3e-2)
        replayed.add(padded_size(batch.batch_size, graphs.sizes))
        return ModelOutput(graph_logits)

    runner.forward = checked_forward
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 300))] for _ in range(64)]
    params = [SamplingParams(max_new_tokens=rng.randint(2, 60), temperature=0, ignore_eos=True) for _ in prompts]
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert all(o.error is None for o in outs)
    assert replayed == set(graphs.sizes), f"never replayed: {set(graphs.sizes) - replayed}"
    assert unused_slots(engine) == 40000
    print(f"{backend}: max |graph - eager| = {worst:.3e}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_graph_generation_equals_eager_generation(backend):
    prompts = [[5 + i, 7, 9 + 2 * i] * (i + 1) for i in range(12)]
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    with_graphs = _engine(backend).generate(input_ids=prompts, sampling_params=params)
    eager = _engine(backend, disable_cuda_graph=True).generate(input_ids=prompts, sampling_params=params)
    same = sum(a.token_ids == b.token_ids for a, b in zip(with_graphs, eager))
    assert same >= len(prompts) - 1, f"{same}/{len(prompts)} identical"


@pytest.mark.parametrize("graphs", ["extend-and-decode", "decode-only"])
def test_second_runner_shares_the_pool(graphs):
    """A second runner capturing into the process pool grows it by less than half of what the first
    did. (On 201eb06, with extend graphs on by default, it grew by as much, 4 MB each, under 4 pytest
    workers: the two cases tell whether the extend ladder is why.)"""
    engine = _engine("triton", disable_extend_graph=graphs == "decode-only")
    first = engine.runner.graph_runner.graph_memory_bytes
    second = GraphRunner(engine.runner.graph_context(), engine.runner.graph_runner.modes)
    second.capture()
    print(f"graph memory: first capture {first / 2**20:.1f} MB, second into the shared pool {second.graph_memory_bytes / 2**20:.1f} MB")
    assert second.graph_memory_bytes < 0.5 * max(first, 1)


def test_runner_built_after_another_was_freed_captures_and_replays():
    """The process pool outlives its runners: free one engine's graphs, capture a new engine's, replay."""
    import gc

    from backplane.executor.graph_runner import global_graph_pool

    prompts = [[5 + i, 7, 9 + 2 * i] * (i + 2) for i in range(6)]
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    first = _engine("triton")
    want = [o.token_ids for o in first.generate(input_ids=prompts, sampling_params=params)]
    pool = global_graph_pool()
    del first
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    second = _engine("triton")
    assert global_graph_pool() == pool
    assert second.runner.graph_runner is not None and second.runner.graph_runner.graphs
    got = [o.token_ids for o in second.generate(input_ids=prompts, sampling_params=params)]
    assert got == want
