"""Extend graphs on the GPU: greedy output with EXTEND captured (triton: full; flashinfer: as it
declares) equals --disable-extend-graph for a padded batch, cached and shared prefixes, chunked
prefill, ngram and EAGLE, and the extend replays really happen; each GPU backend passes the
extend cases of the graph conformance suite.

triton runs in fp32 (the comparison is exact but for kernel order); FlashInfer takes no fp32, so
it runs in fp16 and a divergence passes only at a near-tie of the fp32 model (greedy_ties)."""

from __future__ import annotations

import random

import pytest

from backplane import Engine, SamplingParams
from backplane.contracts.batch import ForwardMode
from backplane.testing import attention_conformance
from backplane.testing.attention_conformance import EXTEND_GRAPH_CASES
from greedy_ties import check_divergences
from helpers_models import save_exact_eagle_head, save_gpu_llama, unused_slots

pytestmark = pytest.mark.gpu

BACKENDS = ["triton", "flashinfer"]
DTYPES = {"triton": "float32", "flashinfer": "float16"}
GREEDY = dict(temperature=0.0, ignore_eos=True)
SPECS = {
    "ngram": dict(speculative_algorithm="ngram", speculative_num_draft_tokens=4),
    "eagle": dict(speculative_algorithm="eagle", speculative_num_steps=3, speculative_eagle_topk=2,
                  speculative_num_draft_tokens=6),
}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A saved one-layer Llama (head dim 64) and an EAGLE head that reproduces it."""
    root = tmp_path_factory.mktemp("extend_graphs_gpu")
    model = save_gpu_llama(root / "target")
    return str(root / "target"), save_exact_eagle_head(model, root / "eagle")


def _engine(path: str, backend: str, extend: bool, **kw) -> Engine:
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    return Engine(path, device="cuda", dtype=DTYPES[backend], attention_backend=backend, max_total_tokens=20000,
                  max_running_requests=16, cuda_graph_max_bs=16, cuda_graph_max_extend_bs=8,
                  disable_extend_graph=not extend, **kw)


def _count_replays(engine: Engine) -> list[tuple]:
    """Every replay of the target runner's graphs: (mode, requests, tokens, prefix lens, key)."""
    graphs, calls = engine.runner.graph_runner, []
    assert graphs is not None, "no graph runner: CUDA graphs were not captured"
    replay = graphs.replay

    def counted(batch, key=None):
        key = key or graphs.key_for(batch)
        prefix = batch.extend_prefix_lens_cpu.tolist() if batch.extend_prefix_lens_cpu is not None else None
        calls.append((batch.forward_mode, batch.batch_size, batch.num_tokens, prefix, key))
        return replay(batch, key)

    graphs.replay = counted
    return calls


def _prompts(count: int, low: int, high: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(low, high))] for _ in range(count)]


SHARED = [5 + (7 * i) % 480 for i in range(90)]
CASES = {
    # one batch of six requests (at most 360 tokens): with the padded request, 8 slots of a bucket up to 512
    "padded": dict(runs=[_prompts(6, 3, 60, 1)]),
    # the same prompts twice (the second round extends over the cached prompts), then shared prefixes
    "cached-prefix": dict(runs=[[SHARED + [7, 8]], [SHARED + [7, 8]], [SHARED + [300 + i] * (i + 1) for i in range(4)]]),
    # chunks of 64: a 300-token prompt runs as five chunks, each one an extend replay
    "chunked": dict(runs=[[[(11 * i) % 490 + 3 for i in range(300)]] + _prompts(3, 5, 30, 2)],
                    settings=dict(chunked_prefill_size=64)),
    "ngram": dict(runs=[[[5, 17, 33] * 8, [7, 8] * 12] + _prompts(4, 5, 60, 3)], settings=SPECS["ngram"]),
    "eagle": dict(runs=[_prompts(6, 5, 80, 4)], settings=SPECS["eagle"]),
}


def _run(engine: Engine, runs) -> list[list[int]]:
    out = []
    for prompts in runs:
        got = engine.generate(input_ids=prompts, sampling_params=SamplingParams(max_new_tokens=24, **GREEDY))
        assert all(o.error is None for o in got), [o.error for o in got]
        out += [o.token_ids for o in got]
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_extend_graphs_equal_eager_extend(target, backend, case):
    path, head = target
    settings = dict(CASES[case].get("settings", {}))
    if case == "eagle":
        settings["speculative_draft_model"] = head
    runs = CASES[case]["runs"]
    plain = _engine(path, backend, extend=False, **settings)
    assert not any(k.ragged for k in plain.runner.graph_runner.graphs), "--disable-extend-graph captured extend"
    want = _run(plain, runs)
    del plain
    engine = _engine(path, backend, extend=True, **settings)
    kinds = engine.runner.graph_runner.kinds
    assert ForwardMode.EXTEND in kinds, f"{backend}: no extend graphs captured ({engine.runner.graph_mode_limits})"
    calls = _count_replays(engine)
    got = _run(engine, runs)
    prompts = [p for prompts in runs for p in prompts]
    check_divergences(path, prompts, want, got, f"{case} {backend} extend graphs ({kinds[ForwardMode.EXTEND]})")
    extend = [c for c in calls if c[0] is ForwardMode.EXTEND]
    assert extend, f"{case} {backend}: no extend replay"
    if case == "padded":
        assert any(c[2] < c[4].token_bucket for c in extend), "no padded extend replay"
    if case in ("cached-prefix", "chunked"):
        assert any(max(c[3]) > 0 for c in extend), f"{case}: no extend over a cached prefix replayed: {extend}"
    if case == "chunked":
        assert sum(1 for c in extend if max(c[3]) > 0) >= 4, f"not every chunk replayed: {extend}"
    if case in SPECS:
        assert any(c[0] is ForwardMode.TARGET_VERIFY for c in calls) and engine.spec_worker.stats.steps > 0
    print(f"{case} {backend}: {len(extend)} extend replays, keys {sorted({(c[4].batch_size, c[4].token_bucket) for c in extend})}")
    assert unused_slots(engine) == 20000


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(EXTEND_GRAPH_CASES))
def test_extend_graph_conformance(backend, case):
    """The suite's extend cases (skipped for a backend that declares no extend graphs)."""
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    attention_conformance.make_graph_suite(backend, device="cuda")(case)
