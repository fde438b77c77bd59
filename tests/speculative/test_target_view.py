"""TargetView, the target as an algorithm reads it: the graph facts (captured sizes, capturable
modes, fill value), another attention backend over a draft's pools, the contract's attributes and
nothing else; the 0.1 attributes (graph_runner, attn_choices, registry) warn and still answer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from backplane import Engine, ReqToTokenPool, TokenToKVPool
from backplane.speculative import SpecContext, TargetRunner, TargetView


@pytest.fixture(scope="module")
def engine():
    return Engine("tiny-llama", device="cpu", attention_backend="torch_native", max_total_tokens=512,
                  speculative_algorithm="ngram")


def test_the_worker_reads_a_view_that_satisfies_the_protocol(engine):
    view = engine.spec_worker.runner
    assert isinstance(view, TargetView) and isinstance(view, TargetRunner)
    assert view.model is engine.runner.model and view.req_to_token_pool is engine.runner.req_to_token_pool
    assert view.context_len == engine.runner.context_len and view.args is engine.args
    assert not isinstance(engine.runner, TargetView)


def test_graph_facts(engine):
    view = engine.spec_worker.runner
    assert view.graph_batch_sizes == ()  # CPU: no graphs
    declared = engine.plugin_set.registry.specs("attention")["torch_native"].graph_modes
    for mode in ("extend", "decode", "target_verify", "draft_extend"):
        assert view.can_capture(mode) == (mode in declared)
    assert view.seq_len_fill_value == engine.runner.seq_len_fill_value
    with pytest.raises(ValueError, match=r"can_capture: mode 'verify': expected one of extend, decode, "
                                         r"target_verify, draft_extend"):
        view.can_capture("verify")


def test_graph_sizes_and_modes_follow_the_runner():
    spec = SimpleNamespace(graph_modes=("decode", "draft_extend"), seq_len_fill_value=1)
    fake = SimpleNamespace(graph_runner=SimpleNamespace(sizes=[8, 1, 4]), seq_len_fill_value=1,
                           attn_choices={"prefill": SimpleNamespace(spec=SimpleNamespace(graph_modes=("draft_extend",))),
                                         "decode": SimpleNamespace(spec=spec)})
    view = TargetView(fake)
    assert view.graph_batch_sizes == (1, 4, 8)
    assert view.can_capture("draft_extend") and not view.can_capture("target_verify") and view.can_capture("decode")
    fake.graph_runner = None
    assert view.graph_batch_sizes == ()


def test_make_attention_backend_builds_the_targets_backend_over_other_pools(engine):
    view = engine.spec_worker.runner
    infos = engine.runner.layer_infos[:1]
    pools = ReqToTokenPool(4, 64, "cpu"), TokenToKVPool(64, 1, infos[0].num_kv_heads, infos[0].head_dim,
                                                        torch.float32, "cpu")
    backend = view.make_attention_backend("decode", *pools, infos)
    assert type(backend) is type(engine.runner.attn_backend) and backend is not engine.runner.attn_backend
    with pytest.raises(ValueError, match="attention role: expected one of decode, prefill, got 'verify'"):
        view.make_attention_backend("verify", *pools, infos)


def test_nothing_else_of_the_runner_and_the_old_names_warn(engine):
    view = engine.spec_worker.runner
    with pytest.raises(AttributeError, match="TargetRunner has no attribute 'scheduler'; an algorithm reads: args, "):
        view.scheduler  # noqa: B018
    for name, instead in (("graph_runner", "graph_batch_sizes"), ("attn_choices", "can_capture"),
                          ("registry", "make_attention_backend")):
        with pytest.warns(DeprecationWarning, match=f"TargetRunner.{name} is deprecated .*TargetRunner.{instead}"):
            assert getattr(view, name) is getattr(engine.runner, name)


def test_spec_context_wraps_any_runner(engine):
    ctx = SpecContext(runner=engine.runner, args=engine.args, spec=engine.spec)
    assert isinstance(ctx.runner, TargetView) and ctx.runner.model is engine.runner.model
    again = SpecContext(runner=ctx.runner, args=engine.args, spec=engine.spec)
    assert again.runner is ctx.runner


def test_the_algorithm_help_names_what_is_registered(engine):
    from backplane.speculative.factory import algorithm_help

    registry = engine.plugin_set.registry
    assert algorithm_help(registry) == f"registered algorithm ({', '.join(sorted(registry.specs('spec')))})"
    assert "eagle" in algorithm_help(registry) and "ngram" in algorithm_help(registry)
    assert algorithm_help(SimpleNamespace(specs=lambda kind: {})) == "registered algorithm (none installed)"


def test_the_algorithm_help_names_a_third_party_algorithm():
    from backplane import SpecAlgorithmSpec, hookimpl
    from backplane.plugin.manager import load_plugins
    from backplane.speculative.factory import algorithm_help

    class Medusa:
        @hookimpl
        def backplane_register_spec_algorithms(self, register):
            register(SpecAlgorithmSpec(name="medusa", factory=lambda ctx: None, description="heads"))

    assert algorithm_help(load_plugins(extra=[Medusa()]).registry) == "registered algorithm (eagle, medusa, ngram)"
