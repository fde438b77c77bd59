"""Extend graphs on CPU: the ladders' arithmetic, and an Engine whose graph runner replays EXTEND
(prefill, chunked prefill, extend over a cached prefix), DECODE and TARGET_VERIFY through the
static buffers with `rerun_capture` (the triton backend interpreted, fp32, a one-layer model):
greedy output identical to eager, and the extend replays counted."""

from __future__ import annotations

import os

import pytest
import torch

from backplane import Engine, SamplingParams
from backplane.contracts.batch import ForwardBatch, ForwardMode
from backplane.contracts.graph import GraphParticipant
from backplane.contracts.memory import ReqToTokenPool, TokenToKVPool
from backplane.executor.graph_runner import GraphRunner, StaticInputs, pad_into, rerun_capture
from backplane.executor.graph_sizes import (GraphKey, capture_kinds, extend_batch_sizes, extend_shape,
                                            extend_token_buckets)
from helpers_models import save_llama_and_eagle

# -- the ladders (no model) ------------------------------------------------------------------------


def test_extend_token_buckets():
    assert extend_token_buckets(512) == [8, 16, 32, 64, 96, 128, 192, 256, 384, 512]
    assert extend_token_buckets(100) == [8, 16, 32, 64, 96, 100]  # the max joins when not a rung
    assert extend_token_buckets(8) == [8]
    assert extend_token_buckets(5) == [5]


def test_extend_batch_sizes():
    assert extend_batch_sizes(8) == [1, 2, 4, 8]
    assert extend_batch_sizes(6) == [1, 2, 4, 6]
    assert extend_batch_sizes(1) == [1]
    assert extend_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 64]


@pytest.mark.parametrize("tokens, requests, shape", [
    (27, 3, (4, 32)),   # bucket 32, three requests and the padded one
    (32, 4, (4, 32)),   # an exact fit needs no padded request
    (32, 3, (4, 32)),   # exact tokens, a spare slot: no padded request needed, 3 -> 4 slots
    (31, 4, (8, 32)),   # four requests and the padded one: the next slot count
    (8, 1, (1, 8)),
    (7, 1, (2, 8)),
    (9, 1, (2, 16)),
    (512, 1, (1, 512)),
    (513, 1, None),     # past the largest bucket
    (20, 8, None),      # eight requests and a padded one: no slot count holds nine
    (0, 1, None),
    (3, 0, None),
])
def test_extend_shape(tokens, requests, shape):
    assert extend_shape(tokens, requests, extend_token_buckets(512), extend_batch_sizes(8)) == shape


def test_extend_shape_never_has_more_slots_than_tokens():
    """Slots beyond the bucket would be requests without a token: such shapes are never chosen."""
    buckets, sizes = [4, 8], [1, 2, 4, 8]
    assert extend_shape(3, 3, buckets, sizes) == (4, 4)
    assert extend_shape(4, 4, buckets, sizes) == (4, 4)
    assert extend_shape(7, 7, buckets, sizes) == (8, 8)
    for n in range(1, 9):
        for bs in range(1, n + 1):
            shape = extend_shape(n, bs, buckets, sizes)
            if shape:
                slots, bucket = shape
                assert bs <= slots <= bucket and n <= bucket and (n == bucket or bs < slots)


def test_capture_kinds():
    full = GraphParticipant("triton", "attention backend 'triton'", ("extend", "decode"))
    piecewise = GraphParticipant("torch_native", "attention backend 'torch_native'", (), piecewise_modes=("extend",))
    lora = GraphParticipant("lora", "LoRA backend 'x'", ("decode",), serves=("decode", "extend"))
    assert capture_kinds(["decode", "extend"], [full]) == ({"decode": "full", "extend": "full"}, [])
    kinds, limits = capture_kinds(["decode", "extend"], [piecewise])
    assert kinds == {"extend": "piecewise"} and limits[0].mode == "decode"
    assert capture_kinds(["extend"], [full, piecewise])[0] == {"extend": "piecewise"}  # the minimum
    kinds, limits = capture_kinds(["decode", "extend"], [full, lora])
    assert kinds == {"decode": "full"} and limits[0].mode == "extend" and limits[0].plugin == "lora"
    assert "declares graph modes: decode" in limits[0].message()


def _pools(max_bs=4, tokens=64):
    return ReqToTokenPool(max_bs + 2, tokens, "cpu"), TokenToKVPool(tokens * 4, 1, 1, 8, torch.float32, "cpu")


def _extend_batch(prefix, new, rows, req_pool, kv_pool) -> ForwardBatch:
    seq = [p + n for p, n in zip(prefix, new)]
    n = sum(new)
    batch = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=len(new),
                         input_ids=torch.arange(1, n + 1), positions=torch.cat([torch.arange(p, p + k) for p, k in zip(prefix, new)]),
                         req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(seq, dtype=torch.int32),
                         seq_lens_cpu=torch.tensor(seq, dtype=torch.int32), out_cache_loc=torch.arange(100, 100 + n),
                         req_to_token_pool=req_pool, token_to_kv_pool=kv_pool)
    batch.set_extend_lens(prefix, new)
    return batch


def test_pad_extend_arithmetic():
    """Three requests (prefix 4, 0, 9; new 3, 5, 2) into 8 slots x 16 tokens: request 3 is the
    padding row with tokens 10..15 (positions 0, dump slot), requests 4..7 have none; logits rows
    are each real request's last token, the padded ones' token 0."""
    req_pool, kv_pool = _pools(8)
    static = StaticInputs.allocate(8, 16, "cpu")
    key = GraphKey(ForwardMode.EXTEND, 8, 0, token_bucket=16)
    batch = _extend_batch([4, 0, 9], [3, 5, 2], [1, 2, 3], req_pool, kv_pool)
    view = pad_into(static, batch, key, pad_row=9, fill=1)
    assert key.ragged and key.num_tokens == 16 and view.batch_size == 8 and view.num_tokens == 16
    assert view.extend_seq_lens_cpu.tolist() == [3, 5, 2, 6, 0, 0, 0, 0]
    assert view.extend_prefix_lens_cpu.tolist() == [4, 0, 9, 0, 0, 0, 0, 0]
    assert view.seq_lens_cpu.tolist() == [7, 5, 11, 6, 0, 0, 0, 0]
    assert view.seq_lens.tolist() == view.seq_lens_cpu.tolist()
    assert view.extend_seq_lens.tolist() == [3, 5, 2, 6, 0, 0, 0, 0]
    assert view.extend_prefix_lens.tolist() == [4, 0, 9, 0, 0, 0, 0, 0]
    assert view.req_pool_indices.tolist() == [1, 2, 3] + [9] * 5
    assert view.logits_indices.tolist() == [2, 7, 9, 0, 0, 0, 0, 0]
    assert view.input_ids[:10].tolist() == list(range(1, 11)) and view.input_ids[10:].tolist() == [0] * 6
    assert view.positions[10:].tolist() == [0] * 6
    assert view.out_cache_loc[:10].tolist() == list(range(100, 110)) and view.out_cache_loc[10:].tolist() == [0] * 6


def test_pad_extend_exact_fit_and_refusals():
    req_pool, kv_pool = _pools(4)
    static = StaticInputs.allocate(4, 16, "cpu")
    exact = _extend_batch([0, 2], [6, 2], [1, 2], req_pool, kv_pool)
    view = pad_into(static, exact, GraphKey(ForwardMode.EXTEND, 2, 0, token_bucket=8), pad_row=5, fill=1)
    assert view.extend_seq_lens_cpu.tolist() == [6, 2] and view.logits_indices.tolist() == [5, 7]
    with pytest.raises(ValueError, match="a padded request needs a slot"):  # 7 tokens, 2 requests in 2 slots x 8
        pad_into(static, _extend_batch([0, 0], [5, 2], [1, 2], req_pool, kv_pool),
                 GraphKey(ForwardMode.EXTEND, 2, 0, token_bucket=8), pad_row=5, fill=1)
    with pytest.raises(ValueError, match="does not fit"):
        pad_into(static, _extend_batch([0], [9], [1], req_pool, kv_pool),
                 GraphKey(ForwardMode.EXTEND, 2, 0, token_bucket=8), pad_row=5, fill=1)


# -- an Engine replaying extend graphs -------------------------------------------------------------

needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available(),
                                       reason="the CPU run of Triton needs TRITON_INTERPRET=1 (and no GPU)")
GREEDY = dict(temperature=0.0, ignore_eos=True)
# Buckets 8, 16, 32 (capped by chunked_prefill_size) of 1, 2, 4 request slots; decode graphs of 4.
SMALL_GRAPHS = dict(cuda_graph_max_tokens=32, cuda_graph_max_extend_bs=4, cuda_graph_bs=[4])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A one-layer Llama (head dim 32, which the triton kernels serve) and an EAGLE head reproducing it."""
    return save_llama_and_eagle(tmp_path_factory.mktemp("extend_graphs"))


class Replays:
    """Wraps a GraphRunner's replay: every replayed batch's (mode, requests, tokens, prefix lens, key)."""

    def __init__(self, graphs: GraphRunner):
        self.calls: list[tuple] = []
        replay = graphs.replay

        def counted(batch, key=None):
            key = key or graphs.key_for(batch)
            prefix = batch.extend_prefix_lens_cpu.tolist() if batch.extend_prefix_lens_cpu is not None else None
            self.calls.append((batch.forward_mode, batch.batch_size, batch.num_tokens, prefix, key))
            return replay(batch, key)

        graphs.replay = counted

    def of(self, mode: ForwardMode) -> list[tuple]:
        return [c for c in self.calls if c[0] is mode]


def _engine(path: str, **kw) -> Engine:
    settings = dict(device="cpu", dtype="float32", attention_backend="triton", max_total_tokens=1024,
                    max_running_requests=6, **SMALL_GRAPHS)
    return Engine(path, **{**settings, **kw})


def _attach_graphs(engine: Engine) -> Replays:
    """What init_cuda_graphs does on CUDA, with rerun_capture: EXTEND and DECODE (and TARGET_VERIFY
    under speculation) captured in full from the runner's own graph context."""
    runner = engine.runner
    modes = {ForwardMode.EXTEND: "full", ForwardMode.DECODE: "full"}
    if runner.args.speculative_algorithm:
        modes[ForwardMode.TARGET_VERIFY] = "full"
    graphs = GraphRunner(runner.graph_context(), modes)
    graphs.capture_fn = rerun_capture
    graphs.capture()
    runner.graph_runner = graphs
    return Replays(graphs)


def _generate(engine: Engine, prompts, max_new: int = 4) -> list[list[int]]:
    outs = engine.generate(input_ids=prompts, sampling_params=SamplingParams(max_new_tokens=max_new, **GREEDY))
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.token_ids for o in outs]


def _eager_then_graphs(engine: Engine, runs: list[list[list[int]]], max_new: int = 4):
    """Generate `runs` (each a list of prompts, in order) eagerly, then again with extend graphs
    from an empty prefix cache; returns (eager outputs, graph outputs, replays)."""
    eager = [_generate(engine, prompts, max_new) for prompts in runs]
    engine.flush_cache()
    replays = _attach_graphs(engine)
    got = [_generate(engine, prompts, max_new) for prompts in runs]
    return eager, got, replays


PADDED = [[5, 17, 33, 4, 9], [40 + i for i in range(9)], [7, 8] * 6 + [3]]  # 5 + 9 + 13 = 27 tokens


@needs_interpreter
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_padded_batch_replays_and_equals_eager(model_dir, overlap):
    engine = _engine(model_dir[0], disable_overlap_schedule=not overlap)
    eager, got, replays = _eager_then_graphs(engine, [PADDED])
    assert got == eager
    extend = replays.of(ForwardMode.EXTEND)
    assert extend, "no extend graph replayed"
    mode, bs, n, prefix, key = extend[0]
    assert (bs, n, key.batch_size, key.token_bucket, key.ragged) == (3, 27, 4, 32, True)  # padded: 3 + 1 slots
    assert replays.of(ForwardMode.DECODE), "no decode graph replayed"


@needs_interpreter
def test_cached_prefix_replays_and_equals_eager(model_dir):
    """The same prompt twice (the second run extends over the cached prefix), then two prompts
    sharing a prefix with it."""
    engine = _engine(model_dir[0])
    base = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
    runs = [[base], [base], [base + [30, 31, 32], base[:10] + [40, 41]]]
    eager, got, replays = _eager_then_graphs(engine, runs)
    assert got == eager
    over_prefix = [c for c in replays.of(ForwardMode.EXTEND) if c[3] and max(c[3]) > 0]
    assert over_prefix, f"no extend over a cached prefix replayed: {replays.of(ForwardMode.EXTEND)}"


@needs_interpreter
def test_chunked_prefill_replays_every_chunk(model_dir):
    """chunked_prefill_size 16 caps the buckets at 16: a 40-token prompt runs as chunks 16, 16, 8,
    each one an extend replay (the later ones over the earlier chunks)."""
    engine = _engine(model_dir[0], chunked_prefill_size=16)
    prompt = [(7 * i) % 250 + 3 for i in range(40)]
    eager, got, replays = _eager_then_graphs(engine, [[prompt]])
    assert got == eager
    chunks = replays.of(ForwardMode.EXTEND)
    assert [(c[2], c[3]) for c in chunks] == [(16, [0]), (16, [16]), (8, [32])], chunks
    assert max(c[4].token_bucket for c in chunks) == 16


@needs_interpreter
def test_ngram_replays_extend_and_verify(model_dir):
    engine = _engine(model_dir[0], speculative_algorithm="ngram", speculative_num_draft_tokens=4)
    prompts = [[5, 17, 33] * 4, [7, 8] * 5]
    eager, got, replays = _eager_then_graphs(engine, [prompts], max_new=8)
    assert got == eager
    assert replays.of(ForwardMode.EXTEND) and replays.of(ForwardMode.TARGET_VERIFY), replays.calls
    assert engine.spec_worker.stats.steps > 0


@needs_interpreter
def test_eagle_replays_extend_and_equals_eager(model_dir):
    path, head = model_dir
    engine = _engine(path, speculative_algorithm="eagle", speculative_draft_model=head, speculative_num_steps=2,
                     speculative_eagle_topk=1, speculative_num_draft_tokens=3)
    prompts = [[5, 17, 33, 4, 9, 2], [40 + i for i in range(9)]]
    eager, got, replays = _eager_then_graphs(engine, [prompts], max_new=6)
    assert got == eager
    assert replays.of(ForwardMode.EXTEND), "the target's prefill (hidden states for the draft) never replayed"
    assert replays.of(ForwardMode.TARGET_VERIFY)
