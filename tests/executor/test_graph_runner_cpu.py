"""Graph-runner logic that needs no GPU: batch sizes, keys, padding, mode limits, eager fallback."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from backplane import Engine
from backplane.contracts.batch import ForwardBatch, ForwardMode
from backplane.executor.graph_runner import GraphRunner, StaticInputs, pad_into
from backplane.executor.graph_sizes import (
    DEFAULT_SIZES,
    GraphKey,
    GraphParticipant,
    capturable_modes,
    capture_batch_sizes,
    capture_kinds,
    combine_variants,
    padded_size,
)
from backplane.contracts.memory import ReqToTokenPool, TokenToKVPool


def flags(**kw):
    base = dict(cuda_graph_bs=None, disable_cuda_graph_padding=False, cuda_graph_max_bs=160,
                enable_torch_compile=False, torch_compile_max_bs=32)
    return SimpleNamespace(**{**base, **kw})


def test_default_sizes_follow_the_ladder():
    sizes, compiled = capture_batch_sizes(flags(), req_pool_size=256)
    assert sizes == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128, 136, 144, 152, 160]
    assert compiled == []


def test_max_bs_cuts_the_ladder():
    assert capture_batch_sizes(flags(cuda_graph_max_bs=20), 256)[0] == [1, 2, 4, 8, 16]


def test_max_bs_extends_the_ladder_up_to_the_pool():
    assert capture_batch_sizes(flags(cuda_graph_max_bs=256), 256)[0] == DEFAULT_SIZES + list(range(168, 257, 8))
    assert capture_batch_sizes(flags(cuda_graph_max_bs=512), 200)[0] == [1, 2, 4] + list(range(8, 200, 8)) + [199, 200]


def test_small_pool_adds_pool_size_and_pool_size_minus_one():
    assert capture_batch_sizes(flags(), 30)[0] == [1, 2, 4, 8, 16, 24, 29, 30]
    assert capture_batch_sizes(flags(), 8)[0] == [1, 2, 4, 7, 8]
    # A max that only cuts the ladder keeps the pool sizes (the GPU graph test's engine: 48 and 48).
    assert capture_batch_sizes(flags(cuda_graph_max_bs=48), 48)[0] == [1, 2, 4, 8, 16, 24, 32, 40, 47, 48]


def test_explicit_sizes_win_but_are_still_cut():
    assert capture_batch_sizes(flags(cuda_graph_bs=[3, 5, 300]), 256)[0] == [3, 5]
    assert capture_batch_sizes(flags(cuda_graph_bs=[3, 5, 100], cuda_graph_max_bs=64), 256)[0] == [3, 5]


def test_no_padding_sizes():
    sizes, _ = capture_batch_sizes(flags(disable_cuda_graph_padding=True), 256)
    assert sizes == list(range(1, 33)) + [64, 128]
    sizes, _ = capture_batch_sizes(flags(disable_cuda_graph_padding=True), 40)
    assert sizes == list(range(1, 33)) + [39, 40]


def test_torch_compile_sizes():
    sizes, compiled = capture_batch_sizes(flags(enable_torch_compile=True, torch_compile_max_bs=16), 256)
    assert compiled == [1, 2, 4, 8, 16] and set(compiled) <= set(sizes)


def test_padded_size():
    assert [padded_size(b, DEFAULT_SIZES) for b in (1, 3, 5, 9, 160)] == [1, 4, 8, 16, 160]
    assert padded_size(161, DEFAULT_SIZES) is None


@pytest.mark.parametrize("padding", [True, False])
def test_without_padding_only_exact_sizes_replay(padding):
    sizes = capture_batch_sizes(flags(disable_cuda_graph_padding=not padding), 256)[0]
    got = [padded_size(b, sizes, allow_padding=padding) for b in (1, 32, 33, 64, 100, 128)]
    assert got == ([1, 32, 40, 64, 104, 128] if padding else [1, 32, None, 64, None, 128])
    # The runner asks for exact sizes under the flag: a batch of 33 has no graph and runs eagerly.
    runner = GraphRunner.__new__(GraphRunner)
    runner.ctx = SimpleNamespace(config=flags(disable_cuda_graph_padding=not padding), contributors=())
    runner.modes, runner.tokens_per_request, runner.sizes = [ForwardMode.DECODE], {ForwardMode.DECODE: 1}, sizes
    runner.graphs = {GraphKey(ForwardMode.DECODE, bs, 1): None for bs in sizes}
    batch = SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=33, num_tokens=33)
    assert runner.key_for(batch) == (GraphKey(ForwardMode.DECODE, 40, 1) if padding else None)


def test_key_composition_from_contributions():
    variants = combine_variants([[(("lora", False),), (("lora", True),)], [(("spec", "eagle"),)]])
    assert variants == [(("lora", False), ("spec", "eagle")), (("lora", True), ("spec", "eagle"))]
    keys = {GraphKey(ForwardMode.DECODE, 8, 1, v) for v in variants}
    assert len(keys) == 2
    assert GraphKey(ForwardMode.TARGET_VERIFY, 8, 4).num_tokens == 32


def test_mode_limit_names_the_plugin():
    parts = [GraphParticipant("attention_triton", "attention backend 'triton'", ("decode", "target_verify"), ("decode",)),
             GraphParticipant("attention.builtin", "attention backend 'torch_native'", (), ("target_verify",)),
             GraphParticipant("lora_slow", "LoRA backend 'slow'", ())]
    modes, limits = capturable_modes(["decode", "target_verify"], parts[:2])
    assert modes == ["decode"]
    assert limits[0].message() == ("CUDA graphs: target_verify runs eagerly because plugin 'attention.builtin' "
                                   "(attention backend 'torch_native') declares graph modes: none")
    modes, limits = capturable_modes(["decode"], parts)
    assert modes == [] and limits[0].plugin == "lora_slow"


def test_padding_arithmetic():
    req_pool = ReqToTokenPool(6, 32, "cpu")
    kv_pool = TokenToKVPool(64, 1, 1, 8, torch.float32, "cpu")
    static = StaticInputs.allocate(8, 8, "cpu")
    static.input_ids.fill_(-1)
    batch = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=3, input_ids=torch.tensor([11, 12, 13]),
                         positions=torch.tensor([4, 9, 2]), req_pool_indices=torch.tensor([0, 2, 1]),
                         seq_lens=torch.tensor([5, 10, 3], dtype=torch.int32),
                         seq_lens_cpu=torch.tensor([5, 10, 3], dtype=torch.int32), out_cache_loc=torch.tensor([7, 8, 9]),
                         req_to_token_pool=req_pool, token_to_kv_pool=kv_pool)
    key = GraphKey(ForwardMode.DECODE, 4, 1)
    padded = pad_into(static, batch, key, pad_row=5, fill=1)
    assert padded.batch_size == 4 and padded.input_ids.tolist() == [11, 12, 13, 0]
    assert padded.req_pool_indices.tolist() == [0, 2, 1, 5]
    assert padded.seq_lens.tolist() == [5, 10, 3, 1] and padded.seq_lens_cpu.tolist() == [5, 10, 3, 1]
    assert padded.out_cache_loc.tolist() == [7, 8, 9, 0]  # the pad writes to the dump slot
    assert padded.positions.tolist() == [4, 9, 2, 0] and padded.forward_mode is key.mode


def test_cpu_runs_eager_and_says_so_once(caplog):
    with caplog.at_level(logging.INFO, logger="backplane.executor.model_runner"):
        engine = Engine("tiny-llama", device="cpu")
    assert engine.runner.graph_runner is None
    assert [r.message for r in caplog.records].count("CUDA graphs need a CUDA device; running eagerly on cpu") == 1
    assert engine.generate(input_ids=[[1, 2, 3]])[0].error is None


def test_graph_participants_of_a_runner():
    engine = Engine("tiny-llama", device="cpu", speculative_algorithm=None)
    parts = engine.runner.graph_participants()
    assert parts[0].plugin == "attention.builtin" and parts[0].graph_modes == ()
    # torch_native plans on the host per batch: its extends are captured piecewise, never in full.
    kinds, limits = capture_kinds(["decode", "extend"], parts)
    assert kinds == {"extend": "piecewise"} and "(piecewise: extend)" in limits[0].message()
    no_piecewise = [GraphParticipant(p.plugin, p.item, p.graph_modes, p.serves) for p in parts]
    modes, limits = capturable_modes(["decode"], no_piecewise)
    assert modes == [] and "plugin 'attention.builtin'" in limits[0].message()


@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_logits_written_into_a_caller_buffer(softcap):
    """Captured graphs share one logits buffer: the processor writes its rows there, same values."""
    from backplane.layers.logits import LogitsProcessor
    from backplane.layers.parallel import ParallelContext

    torch.manual_seed(0)
    head = torch.nn.Linear(16, 40, bias=False).to(torch.bfloat16)
    hidden = torch.randn(5, 16, dtype=torch.bfloat16)
    proc = LogitsProcessor(37, ParallelContext(), softcap)  # a padded vocabulary: 40 rows, 37 used
    batch = SimpleNamespace(logits_indices=None, forward_mode=ForwardMode.DECODE)
    want = proc(hidden, head, batch)
    buffer = torch.full((8, 37), float("nan"))
    got = proc(hidden, head, batch, out=buffer)
    assert got.data_ptr() == buffer.data_ptr() and got.shape == (5, 37)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.isnan(buffer[5:]).all()  # rows past the batch untouched
    with pytest.raises(ValueError, match="logits_out: expected an fp32 buffer of at least 5 rows of 37"):
        proc(hidden, head, batch, out=torch.zeros(4, 37))


def test_the_graph_runner_reads_a_graph_config_resolved_once():
    """GraphConfig carries exactly the settings the graph runner and graph_sizes read, by their flag
    names, so the runner never sees the whole EngineArgs."""
    from backplane.config import GraphConfig, resolve_graphs
    from backplane.settings import EngineArgs

    args = EngineArgs(model="tiny-llama", cuda_graph_bs=[1, 3], enable_torch_compile=True, torch_compile_max_bs=2)
    config = resolve_graphs(args)
    assert isinstance(config, GraphConfig) and config.cuda_graph_bs == (1, 3)
    assert capture_batch_sizes(config, 8) == capture_batch_sizes(args, 8) == ([1, 3], [1])
    engine = Engine("tiny-llama", device="cpu")
    assert isinstance(engine.runner.graph_context().config, GraphConfig)


def test_captures_release_the_host_allocators_cache_too(monkeypatch):
    """Before a capture both allocators return their unused cache, as `torch.cuda.graph` does: the
    pinned host allocator holds a graph pool whose graphs were all freed with zero references until
    then, and a bare `capture_begin` (piecewise capture) into that pool id fails its assert."""
    from backplane.executor import piecewise

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("device"))
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: calls.append("host"), raising=False)
    piecewise.release_allocator_caches()
    assert calls == ["synchronize", "device", "host"]
    monkeypatch.delattr(torch._C, "_host_emptyCache")  # a CPU build of torch has none: skipped
    calls.clear()
    piecewise.release_allocator_caches()
    assert calls == ["synchronize", "device"]
