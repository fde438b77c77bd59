"""A fully cached prompt's one-token prefill on the GPU replays the DECODE graph of its batch size
(BatchLauncher.prefill_runs_as_decode), never an extend graph, and its greedy token equals the
eager EXTEND forward's (the conversion off, no graphs), alone and three at a time, on triton
(fp32: tokens equal, logprobs within 1e-4) and FlashInfer (fp16: a differing token passes only
at a near-tie of the fp32 model, tests/gpu/greedy_ties.py)."""

from __future__ import annotations

import pytest
import torch

from backplane import Engine, SamplingParams
from backplane.contracts.batch import ForwardMode
from backplane.scheduler.launcher import BatchLauncher
from greedy_ties import check_divergences
from helpers_models import count_graph_replays, save_gpu_llama, unused_slots

pytestmark = pytest.mark.gpu

DTYPES = {"triton": "float32", "flashinfer": "float16"}
FIRST_TOKEN = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
LONG = [3 + (13 * i) % 500 for i in range(511)]  # the 511-token prompt of the TTFT measurement
SHORT = [[7 + i, 40, 41 + i, 9] * (5 + i) for i in range(3)]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A saved two-layer Llama (head dim 64, vocabulary 512)."""
    path = tmp_path_factory.mktemp("one_token_extend_gpu") / "target"
    save_gpu_llama(path, num_hidden_layers=2)
    return str(path)


def _engine(path: str, backend: str, **kw) -> Engine:
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    return Engine(path, device="cuda", dtype=DTYPES[backend], attention_backend=backend, max_total_tokens=8192,
                  max_running_requests=8, cuda_graph_max_bs=8, **kw)


def _rounds(engine: Engine) -> list[list]:
    """Round 1 computes the prompts; rounds 2 and 3 find them cached: LONG alone, SHORT together.
    Returns each round's (token ids, logprobs) per request."""
    out = []
    for prompts in ([LONG] + SHORT, [LONG], SHORT):
        got = engine.generate(input_ids=prompts, sampling_params=FIRST_TOKEN)
        assert all(o.error is None for o in got), [o.error for o in got]
        out.append([(o.token_ids, o.logprobs, o.ttft_s) for o in got])
    return out


def _count_replays(engine: Engine) -> list[tuple]:
    assert engine.runner.graph_runner is not None, "no graph runner: CUDA graphs were not captured"
    return count_graph_replays(engine.runner.graph_runner)


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_cached_one_token_prefill_replays_the_decode_graph(target, backend, monkeypatch):
    engine = _engine(target, backend)
    first = engine.generate(input_ids=[LONG] + SHORT, sampling_params=FIRST_TOKEN)
    assert all(o.error is None for o in first)
    calls = _count_replays(engine)
    for prompts, bs in (([LONG], 1), (SHORT, 3)):
        calls.clear()
        got = engine.generate(input_ids=prompts, sampling_params=FIRST_TOKEN)
        assert all(o.error is None for o in got)
        assert len(calls) == 1, calls
        mode, real_bs, key = calls[0]
        assert (mode, real_bs, key.mode, key.ragged) == (ForwardMode.DECODE, bs, ForwardMode.DECODE, False), calls
        assert key.batch_size >= bs
        print(f"{backend}: {bs} cached prompt(s) replayed {key}; ttft {[round(o.ttft_s * 1e3, 3) for o in got]} ms")
    assert unused_slots(engine) == 8192

    graphs = _rounds(_engine(target, backend))
    monkeypatch.setattr(BatchLauncher, "prefill_runs_as_decode", lambda self, reqs, chunks: False)
    eager = _rounds(_engine(target, backend, disable_cuda_graph=True))
    want = [t for rnd in eager for t, _, _ in rnd]
    got = [t for rnd in graphs for t, _, _ in rnd]
    prompts = [LONG] + SHORT + [LONG] + SHORT
    if backend == "triton":
        assert got == want
        for rnd_g, rnd_e in zip(graphs, eager):
            for (_, lp_g, _), (_, lp_e, _) in zip(rnd_g, rnd_e):
                assert torch.allclose(torch.tensor(lp_g), torch.tensor(lp_e), atol=1e-4, rtol=0), (lp_g, lp_e)
    else:
        check_divergences(target, prompts, want, got, f"{backend} one-token prefill as decode")
