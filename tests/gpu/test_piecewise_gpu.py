"""Piecewise capture (graph segments between eager attention calls) equals eager (GPU).

torch_native declares extend piecewise: its extend graphs are PiecewiseGraphs whose segments sit
between its eager attention calls, and greedy generation equals the eager engine's.
"""

from __future__ import annotations

import gc

import pytest
import torch

from backplane import Engine, SamplingParams
from backplane.contracts.batch import ForwardMode
from backplane.executor.piecewise import PiecewiseGraph

pytestmark = pytest.mark.gpu


def _engine(**kw) -> Engine:
    """Extend graphs up to 8 request slots and 256 tokens: the prompts below fit them in one batch
    (7 requests and 143 tokens; 5 and 95), with the padded request. (Up to 2026-12-07 they held
    128 tokens and 4 slots, which neither batch fits: nothing replayed, and both tests failed.)"""
    return Engine("tiny-llama", device="cuda", dtype="bfloat16", attention_backend="torch_native",
                  max_total_tokens=20000, max_running_requests=16, cuda_graph_max_bs=8, cuda_graph_max_tokens=256,
                  cuda_graph_max_extend_bs=8, **{"disable_extend_graph": False, **kw})


def test_torch_native_captures_piecewise_and_generates_as_eager():
    prompts = [[5 + i, 7, 9 + 2 * i] * (i + 1) for i in range(6)] + [[11, 12] * 40]
    params = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    engine = _engine()
    graphs = engine.runner.graph_runner
    assert graphs is not None and graphs.kinds == {ForwardMode.EXTEND: "piecewise"}
    some = next(iter(graphs.graphs.values()))
    layers = engine.runner.model.num_layers
    assert isinstance(some, PiecewiseGraph) and len(some.segments) == layers + 1 and len(some.calls) == layers
    replays = {"extend": 0, "decode": 0}
    replay = graphs.replay

    def counting(batch, key=None):
        replays[batch.forward_mode.value] += 1
        return replay(batch, key)

    graphs.replay = counting
    got = [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=params)]
    want = [o.token_ids for o in _engine(disable_cuda_graph=True).generate(input_ids=prompts, sampling_params=params)]
    assert replays["extend"] >= 1, replays
    same = sum(a == b for a, b in zip(got, want))
    assert same >= len(prompts) - 1, f"{same}/{len(prompts)} identical"


def test_piecewise_replay_logits_equal_eager_logits():
    engine = _engine()
    runner, graphs = engine.runner, engine.runner.graph_runner
    worst = []

    @torch.inference_mode()
    def checked(batch, **kw):
        if not graphs.can_run(batch):
            return runner.forward_eager(batch, **kw)
        got = graphs.replay(batch).logits.clone()
        want = runner.forward_eager(batch).logits
        torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
        worst.append(float((got - want).abs().max()))
        return graphs.replay(batch)

    runner.forward = checked
    prompts = [[3 + i] * (5 + 7 * i) for i in range(5)]
    outs = engine.generate(input_ids=prompts, sampling_params=SamplingParams(max_new_tokens=6, temperature=0))
    assert all(o.error is None for o in outs) and len(worst) >= 1


def test_piecewise_capture_after_a_freed_engine_with_full_graphs():
    """The GPU matrix of 2026-12-07 (H100, torch 2.11): the first torch_native engine built after an
    engine with full graphs had been freed failed its first segment's `capture_begin` in the pinned
    host allocator (`use_count > 0` INTERNAL ASSERT): the host side of the shared graph pool had
    dropped to zero references, and only `torch.cuda.graph`, not a bare `capture_begin`, empties
    that cache first. Piecewise capture now does what `torch.cuda.graph` does."""
    first = Engine("tiny-llama", device="cuda", dtype="bfloat16", attention_backend="triton",
                   max_total_tokens=4096, cuda_graph_max_bs=2, cuda_graph_max_tokens=32, cuda_graph_max_extend_bs=2,
                   disable_extend_graph=False)
    assert first.runner.graph_runner is not None and first.runner.graph_runner.graphs
    first.shutdown()
    del first
    gc.collect()
    engine = _engine()
    assert engine.runner.graph_runner.kinds == {ForwardMode.EXTEND: "piecewise"}
    prompts = [[5, 7, 9] * 3, [4, 4, 8] * 5]
    params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert all(o.error is None and len(o.token_ids) == 4 for o in outs), [o.error for o in outs]
