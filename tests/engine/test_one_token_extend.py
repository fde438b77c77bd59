"""A prefill batch whose every request computes one new token (a fully cached prompt's last
token, a chunked prompt's last chunk of one) runs as the DECODE batch it equals
(`BatchLauncher.prefill_runs_as_decode`): the modes the model runner sees are counted, and greedy
tokens, logprobs and the pools' state equal those with the conversion turned off (the decision
monkeypatched to False). Cases that must stay EXTEND: a batch with a request of 2+ new tokens,
EAGLE (it keeps the target's hidden states of the prefill), tensor parallelism (a worker learns a
cached prefix's slots from EXTEND messages only). On CPU with the triton backend interpreted, the
cached request replays the decode graph (`rerun_capture`)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from backplane import Engine, SamplingParams
from backplane.contracts.batch import ForwardMode
from backplane.executor.graph_runner import GraphRunner, rerun_capture
from backplane.scheduler.launcher import BatchLauncher, _plain_prefill
from backplane.scheduler.request import Req
from backplane.speculative import SpecWorker
from helpers_models import count_graph_replays, save_llama_and_eagle, unused_slots
from lora_helpers import make_lora_world

DECODE, EXTEND, VERIFY = ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY
CPU = dict(device="cpu", dtype="float32", load_format="dummy", disable_cuda_graph=True, seed=3, max_total_tokens=1024)
needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available(),
                                       reason="the CPU run of Triton needs TRITON_INTERPRET=1 (and no GPU)")
# Three prompts with nothing in common (distinct first tokens).
PROMPTS = [[5 + i, 17, 33, 2, 9, 40 + i, 11, 60 + 3 * i, 8] for i in range(3)]
# PROMPTS[1]'s first 5 tokens are cached: this one computes 2 new tokens.
TWO_NEW = PROMPTS[1][:5] + [77, 78]


def greedy(max_new: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)


def record_modes(engine: Engine) -> list[tuple[ForwardMode, int, int]]:
    """Wrap the runner's forward: (mode, requests, tokens) of every batch it runs."""
    calls, forward = [], engine.runner.forward

    def recording(batch, **options):
        calls.append((batch.forward_mode, batch.batch_size, batch.num_tokens))
        return forward(batch, **options)

    engine.runner.forward = recording
    return calls


def never_as_decode(monkeypatch) -> None:
    """The conversion off: every prefill runs as EXTEND, as before it."""
    monkeypatch.setattr(BatchLauncher, "prefill_runs_as_decode", lambda self, reqs, chunks: False)


def pool_state(engine: Engine) -> tuple[int, int, int, int]:
    """(free KV slots, slots the radix tree keeps, of them referenced, free request rows)."""
    tree = engine.scheduler.prefix_cache.tree
    return (engine.runner.token_to_kv_pool.num_free, tree.total_size, tree.protected_size,
            engine.runner.req_to_token_pool.num_free)


def run(engine: Engine, prompts, max_new: int, **kw) -> list[tuple[list[int], list[float]]]:
    outs = engine.generate(input_ids=prompts, sampling_params=greedy(max_new), **kw)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [(o.token_ids, o.logprobs) for o in outs]


def assert_same(got, want, atol: float = 1e-5) -> None:
    """Token for token, and every logprob within `atol`."""
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=atol, rtol=0), (a, b)


# -- what reaches the model runner ------------------------------------------------------------------


def test_cached_prompts_reach_the_runner_as_one_decode_batch():
    engine = Engine("tiny-llama", **CPU)
    run(engine, PROMPTS, 1)
    calls = record_modes(engine)
    run(engine, PROMPTS[:1], 1)  # one cached prompt: its last token only
    assert calls == [(DECODE, 1, 1)]
    calls.clear()
    run(engine, PROMPTS, 1)  # three of them: one decode batch
    assert calls == [(DECODE, 3, 3)]
    calls.clear()
    run(engine, [PROMPTS[0], TWO_NEW], 1)  # one token and two: stays EXTEND
    assert calls == [(EXTEND, 2, 3)]
    calls.clear()
    run(engine, [[200, 201, 202]], 1)  # a fresh prompt: EXTEND as ever
    assert calls == [(EXTEND, 1, 3)]
    assert unused_slots(engine) == engine.runner.token_to_kv_pool.num_slots


def test_the_decision_reads_every_chunk():
    launcher = engine_launcher()
    reqs = [Req(i, [1, 2, 3], greedy(1)) for i in range(3)]
    assert launcher.prefill_runs_as_decode(reqs, [1, 1, 1])
    assert not launcher.prefill_runs_as_decode(reqs, [1, 2, 1])
    assert not launcher.prefill_runs_as_decode(reqs[:1], [3])


def engine_launcher(tp_size: int = 1, spec_worker=None) -> BatchLauncher:
    runner = SimpleNamespace(token_to_kv_pool=None, req_to_token_pool=None, parallel=SimpleNamespace(tp_size=tp_size))
    return BatchLauncher(runner, [], spec_worker=spec_worker, generator=torch.Generator())


# -- equal to the extend form -----------------------------------------------------------------------


def serve_rounds(engine: Engine) -> tuple[list, list, tuple]:
    """Round 1 computes PROMPTS; later rounds hit the cache: one prompt, all three, a mix with a
    request of two new tokens. Returns every round's outputs, the first batch (mode, requests,
    tokens) of each round and the pools' state at the end."""
    calls, outs, firsts = record_modes(engine), [], []
    for prompts in (PROMPTS, PROMPTS[2:], PROMPTS, [TWO_NEW, PROMPTS[0]]):
        outs += run(engine, prompts, 4)
        firsts.append(calls[0])
        calls.clear()
    assert unused_slots(engine) == engine.runner.token_to_kv_pool.num_slots
    return outs, firsts, pool_state(engine)


BACKENDS = [pytest.param(dict(), id="torch_native"),
            pytest.param(dict(attention_backend="triton"), id="triton", marks=needs_interpreter)]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_outputs_and_pools_equal_the_extend_form(backend, overlap, monkeypatch):
    settings = dict(CPU, disable_overlap_schedule=not overlap, **backend)
    got, firsts, pools = serve_rounds(Engine("tiny-llama", **settings))
    assert firsts == [(EXTEND, 3, 27), (DECODE, 1, 1), (DECODE, 3, 3), (EXTEND, 2, 3)]
    never_as_decode(monkeypatch)
    want, plain_firsts, plain_pools = serve_rounds(Engine("tiny-llama", **settings))
    assert plain_firsts == [(EXTEND, 3, 27), (EXTEND, 1, 1), (EXTEND, 3, 3), (EXTEND, 2, 3)]
    assert pools == plain_pools  # free slots, radix tree size and references, free rows
    assert_same(got, want)


def test_chunked_prefill_whose_last_chunk_is_one_token(monkeypatch):
    """chunked_prefill_size 8: a 17-token prompt runs as chunks 8, 8 and 1 (DECODE); next to
    it a 5-token prompt shares the third batch, which stays EXTEND."""
    settings = dict(CPU, chunked_prefill_size=8, disable_radix_cache=True)
    prompt = [(7 * i) % 250 + 3 for i in range(17)]

    def serve(engine):
        calls = record_modes(engine)
        alone = run(engine, [prompt], 3)
        prefills = calls[:3]
        calls.clear()
        mixed = run(engine, [prompt, [90, 91, 92, 93, 94]], 3)
        return alone + mixed, prefills, calls[:3], pool_state(engine)

    got, prefills, mixed_prefills, pools = serve(Engine("tiny-llama", **settings))
    assert prefills == [(EXTEND, 1, 8), (EXTEND, 1, 8), (DECODE, 1, 1)]
    # the long prompt's first two chunks fill the token budget; then its last token and the short prompt
    assert mixed_prefills == [(EXTEND, 1, 8), (EXTEND, 1, 8), (EXTEND, 2, 6)]
    never_as_decode(monkeypatch)
    want, plain_prefills, _, plain_pools = serve(Engine("tiny-llama", **settings))
    assert plain_prefills[2] == (EXTEND, 1, 1)
    assert pools == plain_pools
    assert_same(got, want)


def test_lora_requests_run_as_decode_with_their_adapters(tmp_path, monkeypatch):
    world = make_lora_world(tmp_path)
    settings = dict(device="cpu", dtype="float32", max_total_tokens=1024, lora_paths=world.lora_paths(),
                    lora_backend="torch_native", disable_cuda_graph=True)
    adapters = ["all7_r4", None, "qv_down_r8"]

    def serve(engine):
        calls = record_modes(engine)
        first = run(engine, PROMPTS, 3, lora=adapters)
        calls.clear()
        again = run(engine, PROMPTS, 3, lora=adapters)
        return first + again, calls[0], pool_state(engine)

    got, cached_call, pools = serve(Engine(str(world.base_dir), **settings))
    assert cached_call == (DECODE, 3, 3)
    never_as_decode(monkeypatch)
    want, plain_call, plain_pools = serve(Engine(str(world.base_dir), **settings))
    assert plain_call == (EXTEND, 3, 3) and pools == plain_pools
    assert_same(got, want)
    assert len({tuple(t) for t, _ in got[:3]}) == 3  # the adapters do change the output


# -- speculative decoding ---------------------------------------------------------------------------


def test_ngram_runs_cached_prompts_as_decode(monkeypatch):
    """ngram keeps nothing of a prefill: its cached one-token prefills run as DECODE too."""
    settings = dict(CPU, speculative_algorithm="ngram", speculative_num_draft_tokens=3)
    prompts = [[5, 17, 33] * 3, [7, 8] * 4 + [9]]

    def serve(engine):
        calls = record_modes(engine)
        outs = run(engine, prompts, 6)
        calls.clear()
        outs += run(engine, prompts, 6)
        assert VERIFY in {c[0] for c in calls}
        return outs, calls[0], pool_state(engine)

    engine = Engine("tiny-llama", **settings)
    assert _plain_prefill(engine.spec_worker)
    got, cached_call, pools = serve(engine)
    assert cached_call == (DECODE, 2, 2)
    never_as_decode(monkeypatch)
    want, plain_call, plain_pools = serve(Engine("tiny-llama", **settings))
    assert plain_call == (EXTEND, 2, 2) and pools == plain_pools
    assert_same(got, want)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    """A one-layer Llama (head dim 32, which the triton kernels serve) and an EAGLE head reproducing it."""
    return save_llama_and_eagle(tmp_path_factory.mktemp("one_token_extend"))


def test_eagle_keeps_a_one_token_chunk_extend(small_model):
    """EAGLE refuses the prefix cache; a chunked prompt's last chunk of one token stays EXTEND (the
    draft keeps the target's hidden states of every prefilled token)."""
    path, head = small_model
    engine = Engine(path, device="cpu", dtype="float32", max_total_tokens=1024, disable_cuda_graph=True,
                    chunked_prefill_size=8, speculative_algorithm="eagle", speculative_draft_model=head,
                    speculative_num_steps=2, speculative_eagle_topk=1, speculative_num_draft_tokens=3)
    assert not _plain_prefill(engine.spec_worker)
    calls = record_modes(engine)
    run(engine, [[(5 * i) % 200 + 3 for i in range(9)]], 4)
    assert calls[:2] == [(EXTEND, 1, 8), (EXTEND, 1, 1)]
    assert DECODE not in {c[0] for c in calls}


def test_an_algorithm_that_reads_the_prefill_keeps_extend():
    class Recording(SpecWorker):
        def draft(self, reqs):
            raise AssertionError("not called")

        def after_prefill(self, reqs, chunks, output):
            pass

    class Plain(Recording):
        after_prefill = SpecWorker.after_prefill

    class Hidden(Plain):
        capture_hidden = True

    reqs, ones = [Req(0, [1, 2], greedy(1))], [1]
    assert not engine_launcher(spec_worker=Recording.__new__(Recording)).prefill_runs_as_decode(reqs, ones)
    assert not engine_launcher(spec_worker=Hidden.__new__(Hidden)).prefill_runs_as_decode(reqs, ones)
    assert engine_launcher(spec_worker=Plain.__new__(Plain)).prefill_runs_as_decode(reqs, ones)
    assert not engine_launcher(spec_worker=object()).prefill_runs_as_decode(reqs, ones)  # not a SpecWorker


def test_tensor_parallelism_converts_too():
    reqs = [Req(0, [1, 2], greedy(1))]
    assert engine_launcher(tp_size=1).prefill_runs_as_decode(reqs, [1])
    assert engine_launcher(tp_size=2).prefill_runs_as_decode(reqs, [1])


# -- the decode graph replays it ---------------------------------------------------------------------


def attach_graphs(engine: Engine) -> list[tuple]:
    """EXTEND and DECODE graphs captured with `rerun_capture` from the runner's own graph context
    (what init_cuda_graphs does on CUDA); returns the list of every replay's (mode, requests, key)."""
    graphs = GraphRunner(engine.runner.graph_context(), {EXTEND: "full", DECODE: "full"})
    graphs.capture_fn = rerun_capture
    graphs.capture()
    engine.runner.graph_runner = graphs
    return count_graph_replays(graphs)


@needs_interpreter
def test_a_cached_prompt_replays_the_decode_graph(small_model):
    engine = Engine(small_model[0], device="cpu", dtype="float32", attention_backend="triton", max_total_tokens=1024,
                    max_running_requests=4, cuda_graph_max_tokens=32, cuda_graph_max_extend_bs=4, cuda_graph_bs=[1, 2, 4])
    prompts = [[11 + i, 12, 13, 14, 15, 16, 17, 18, 19, 20 + i] for i in range(2)]
    eager = run(engine, prompts, 1)  # no graphs yet: the whole prompts, eager EXTEND
    replays = attach_graphs(engine)
    got = run(engine, prompts, 1)
    assert [(mode, bs, key.mode, key.batch_size, key.ragged) for mode, bs, key in replays] == [
        (DECODE, 2, DECODE, 2, False)]
    assert_same(got, eager)


def test_a_tensor_parallel_engine_converts_and_equals_tp1():
    """At tp 2 a cached prompt's one-token prefill runs as DECODE too, its message carrying the
    cached prefix's slots, which a worker's row lacks: PROMPTS[0] comes back in the row PROMPTS[2]
    had (the worker's row still holds PROMPTS[2]'s slots), where a DECODE message without them gave
    other tokens."""
    settings = dict(model="tiny-llama", device="cpu", dtype="float32", max_total_tokens=400, seed=7)
    rounds = [PROMPTS, [PROMPTS[2]], [PROMPTS[0]]]

    def serve(engine):
        calls, rows, outs, firsts = record_modes(engine), [], [], []
        prefill = engine.scheduler.launcher.forward_prefill
        engine.scheduler.launcher.forward_prefill = lambda reqs, chunks: rows.append(reqs[0].row) or prefill(reqs, chunks)
        try:
            for prompts in rounds:
                outs += run(engine, prompts, 4)
                firsts.append(calls[0])
                calls.clear()
        finally:
            engine.shutdown()
        return outs, firsts[1:], rows

    want, tp1_calls, _ = serve(Engine(**settings))
    got, tp2_calls, rows = serve(Engine(**settings, tp_size=2))
    assert tp1_calls == [(DECODE, 1, 1)] * 2 and tp2_calls == [(DECODE, 1, 1)] * 2
    assert rows[1] == rows[2]  # PROMPTS[0] reuses PROMPTS[2]'s row
    assert_same(got, want, atol=1e-4)
