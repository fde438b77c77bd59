"""The model conformance suite's engine-mode checks: `tensor_parallel` (2 CPU ranks, gloo) passes the Llama
family with a replicated KV head and fails on planted tensor-parallel bugs that whole-model greedy misses;
`graphs`' comparison and the suite's cases (first seed only, `gpu` marker) on the CPU.

The planted models reach the worker processes as a pickled plugin object: its class and factories are
imported from this module there (pytest puts this folder on sys.path, which the workers inherit).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import transformers

from backplane import ModelSpec, hookimpl
from backplane.layers import ParallelContext, RowParallelLinear
from backplane.testing import model_conformance
from backplane.testing.model_conformance import GRAPH_TIE_FRACTION, assert_same_greedy, check_model, save_reference


def _llama(hf_config, ctx):
    from backplane.models.llama import LlamaForCausalLM, build_model

    return build_model(LlamaForCausalLM, hf_config, ctx)


def no_all_reduce(hf_config, ctx):
    """o_proj and down_proj keep their partial sums: right at one rank, wrong at two."""
    model = _llama(hf_config, ctx)
    for module in model.modules():
        if isinstance(module, RowParallelLinear):
            module.reduce_results = False
    return model


def other_ranks_shard(hf_config, ctx):
    """down_proj loads the input columns of rank tp_size - 1 - rank (its own at one rank)."""
    model = _llama(hf_config, ctx)
    for layer in model.model.layers:
        param = layer.mlp.down_proj.weight
        load = param.weight_loader

        def swapped(p, full, shard_id=None, load=load):
            load(p, torch.cat(full.chunk(ctx.parallel.tp_size, dim=1)[::-1], dim=1), shard_id)
        param.weight_loader = swapped
    return model


def not_split(hf_config, ctx):
    """Every rank builds the whole model (a model of plain linears): right tokens, no tensor parallelism."""
    whole = copy.copy(ctx)
    whole.parallel = ParallelContext()
    return _llama(hf_config, whole)


PLANTED = {"NoAllReduceLlama": no_all_reduce, "OtherRanksShardLlama": other_ranks_shard, "NotSplitLlama": not_split}


class PlantedTensorParallelBugs:
    @hookimpl
    def backplane_register_models(self, register):
        for architecture, factory in PLANTED.items():
            register(ModelSpec(architecture=architecture, factory=factory, description="a planted bug"))


def test_llama_with_one_kv_head_passes_on_two_ranks(tmp_path):
    """Seed 2 draws one KV head: both ranks hold it (replicated), each half of the query heads."""
    reference = save_reference("LlamaForCausalLM", transformers.LlamaConfig, 2, tmp_path)
    assert reference.model.config.num_key_value_heads == 1
    check_model(reference, "tensor_parallel", 2)


@pytest.mark.parametrize("architecture, message", [
    ("NoAllReduceLlama", "tensor parallel 2, request 0: token 0 logprob"),
    ("OtherRanksShardLlama", "tensor parallel 2, request 0: token 0 logprob"),
    ("NotSplitLlama", r"hold \(query, KV\) heads \[\(4, 2\)\], expected \(2, 1\)"),
])
def test_a_planted_tensor_parallel_bug_fails_only_the_tensor_parallel_check(architecture, message, tmp_path):
    reference = save_reference(architecture, transformers.LlamaConfig, 0, tmp_path)
    check_model(reference, "greedy", 0, plugins=[PlantedTensorParallelBugs()])
    with pytest.raises(AssertionError, match=message):
        check_model(reference, "tensor_parallel", 0, plugins=[PlantedTensorParallelBugs()])


# -- graphs: the comparison, the cases, the refusals (the replay itself needs CUDA) ----------------

@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_reference("LlamaForCausalLM", transformers.LlamaConfig, 0, tmp_path_factory.mktemp("llama"))


def _closest_and_farthest_pairs(reference, prompt):
    """Token pairs of the fp32 reference's next-token logits: the closest two, and the best and worst."""
    with torch.no_grad():
        row = reference.model(torch.tensor([prompt])).logits[0, -1]
    values, order = row.sort()
    i = int((values[1:] - values[:-1]).argmin())
    return (int(order[i]), int(order[i + 1])), (int(order[-1]), int(order[0]))


def _output(tokens, logprobs):
    return SimpleNamespace(token_ids=tokens, logprobs=logprobs)


def test_graph_comparison_allows_a_near_tie_and_nothing_else(llama):
    prompt = [5, 9, 22, 7]
    (a, b), (best, worst) = _closest_and_farthest_pairs(llama, prompt + [40])
    want = _output([40, b, 3], [-1.0, -2.0, -3.0])
    assert_same_greedy("same", prompt, _output([40, b, 3], [-1.01, -2.02, -3.03]), want, llama)
    assert_same_greedy("tie", prompt, _output([40, a, 17], [-1.0, -2.5, -0.1]), want, llama)
    with pytest.raises(AssertionError, match=f"token 1 is {worst}, expected {best} .* near tie is <= {GRAPH_TIE_FRACTION}"):
        assert_same_greedy("far", prompt, _output([40, worst, 3], [-1.0, -2.0, -3.0]), _output([40, best, 3], want.logprobs),
                           llama)
    with pytest.raises(AssertionError, match="token 0 logprob -1.1000, expected -1.0000"):
        assert_same_greedy("logprob", prompt, _output([40, b, 3], [-1.1, -2.0, -3.0]), want, llama)
    with pytest.raises(AssertionError, match="2 tokens, expected 3"):
        assert_same_greedy("short", prompt, _output([40, b], [-1.0, -2.0]), want, llama)


def test_suite_cases_run_engine_modes_for_the_first_seed_and_graphs_per_backend_on_the_gpu():
    cases = model_conformance.suite_cases((4, 5), model_conformance.CHECKS)
    ids = [case.id for case in cases]
    assert ids == ["seed4-greedy", "seed4-chunked_prefill", "seed4-prefix_cache", "seed4-preemption",
                   "seed4-tensor_parallel", "seed4-graphs-triton", "seed4-graphs-flashinfer",
                   "seed5-greedy", "seed5-chunked_prefill", "seed5-prefix_cache", "seed5-preemption"]
    gpu = [case.id for case in cases if any(mark.name == "gpu" for mark in case.marks)]
    assert gpu == ["seed4-graphs-triton", "seed4-graphs-flashinfer"]
    assert cases[6].values == (4, "graphs", "flashinfer")


def test_graphs_shape_serves_the_gpu_backends(llama):
    graphs = llama.reshaped("graphs", model_conformance.GRAPH_SHAPE)
    config = graphs.model.config
    assert (config.head_dim, config.hidden_size, config.num_key_value_heads) == (64, 256, 2)
    assert graphs.path.name == f"{llama.path.name}-graphs" and llama.reshaped("graphs", {}) is graphs
    with pytest.raises(ValueError, match="needs save_reference's recipe"):
        model_conformance.Reference(llama.model, llama.path).reshaped("graphs", {})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's answer")
def test_graphs_skip_without_cuda(llama):
    with pytest.raises(pytest.skip.Exception, match="graphs: needs a CUDA device"):
        check_model(llama, "graphs", 0)


def test_an_attention_backend_is_for_the_graphs_check_only(llama):
    with pytest.raises(ValueError, match="attention_backend: only the graphs check takes one, got 'triton' for 'greedy'"):
        check_model(llama, "greedy", 0, attention_backend="triton")
    assert model_conformance.graph_backend_problem("nope") == "attention backend 'nope' is not registered"
