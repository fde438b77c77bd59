"""The runner's collaborators join through declared Protocols (backplane.contracts.protocols): a
contributor handed to the runner keys the graphs, binds its state for capture and replay and is
called before every eager forward; registration refuses a wrong object or a late one; the LoRA
manager, the TP driver and the scheduler conform to the Protocols they are passed as."""

from __future__ import annotations

import pytest
import torch

from backplane import Engine
from backplane.distributed.driver import TPDriver
from backplane.scheduler.batch_builder import build_extend_batch
from backplane.scheduler.request import Req
from backplane.scheduler.sampling_params import SamplingParams
from backplane.contracts.batch import ForwardBatch, ForwardMode
from backplane.executor.graph_runner import GraphRunner
from backplane.contracts.graph import GraphKey, GraphParticipant
from backplane.executor.model_runner import ModelRunner
from backplane.contracts.protocols import ForwardRouter, GraphContributor, RunningRequests, SchedulerParticipant
from backplane.lora.manager import LoraManager
from backplane.contracts.model import ModelOutput
from backplane.plugin.manager import load_plugins
from backplane.settings import build_server_args
from backplane.speculative import TargetRunner, TargetView


class NoGraph:
    def replay(self) -> None:
        pass


class Recorder:
    """A GraphContributor keying graphs by the parity of the real batch size; records each call."""

    def __init__(self, log: list):
        self.log = log

    def begin_forward(self, batch):
        self.log.append(("begin_forward", batch.batch_size))
        return {"recorder": ("eager", batch.batch_size)}

    def graph_participant(self):
        return GraphParticipant("recorder", "test contributor", ("decode",))

    def graph_variants(self):
        return [(("parity", 0),), (("parity", 1),)]

    def graph_key_extras(self, batch):
        return (("parity", batch.batch_size % 2),)

    def prepare_graph_batch(self, batch, key, real=None):
        self.log.append(("prepare_graph_batch", key, None if real is None else real.batch_size))
        return {"recorder": ("graph", key.batch_size)}


@pytest.fixture(scope="module")
def plugin_set():
    return load_plugins()


def tiny_runner(plugin_set) -> ModelRunner:
    args = build_server_args(dict(model="tiny-llama", device="cpu", max_total_tokens=256, max_running_requests=8),
                             plugin_set.settings_groups(), {})
    return ModelRunner(args, plugin_set)


def decode_batch(runner: ModelRunner, bs: int) -> ForwardBatch:
    """A DECODE batch of `bs` requests at seq_len 1 (enough for the graph runner's keys and padding)."""
    ones = torch.ones(bs, dtype=torch.int32)
    return ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=torch.zeros(bs, dtype=torch.int64),
                        positions=torch.zeros(bs, dtype=torch.int64), req_pool_indices=torch.arange(bs), seq_lens=ones,
                        seq_lens_cpu=ones.clone(), out_cache_loc=torch.arange(1, bs + 1),
                        req_to_token_pool=runner.req_to_token_pool, token_to_kv_pool=runner.token_to_kv_pool)


def record_model(runner: ModelRunner, log: list, monkeypatch) -> None:
    """Make the model log what its bound ForwardContext holds when it runs."""
    model_forward = runner.model.forward

    def forward(batch):
        bound = runner.model_ctx.forward
        log.append(("model", batch.batch_size, bound.binding("recorder"), bound.graph_key))
        return model_forward(batch)

    monkeypatch.setattr(runner.model, "forward", forward)


def test_a_contributor_keys_the_graphs_and_binds_capture_and_replay(plugin_set, monkeypatch):
    runner, log = tiny_runner(plugin_set), []
    recorder = Recorder(log)
    runner.add_contributor(recorder)
    assert runner.graph_participants()[-1].plugin == "recorder"
    assert runner.graph_context().contributors == (recorder,)
    # torch_native has no graph state; the keys, padding and contributor calls run on CPU for real.
    monkeypatch.setattr(runner.attn_backend, "init_graph_state", lambda *args: None)
    graphs = GraphRunner(runner.graph_context(), [ForwardMode.DECODE])
    assert {key.extras for key in graphs.keys()} == {(("parity", 0),), (("parity", 1),)}
    assert len(graphs.keys()) == 2 * len(graphs.sizes)
    graphs.graphs = {key: None for key in graphs.keys()}
    assert graphs.key_for(decode_batch(runner, 3)) == GraphKey(ForwardMode.DECODE, 4, 1, (("parity", 1),))
    assert graphs.key_for(decode_batch(runner, 2)).extras == (("parity", 0),)
    key = GraphKey(ForwardMode.DECODE, 4, 1, (("parity", 1),))
    # Capture with a stand-in for torch.cuda.graph: the model runs once under the capture's context.
    record_model(runner, log, monkeypatch)
    monkeypatch.setattr(runner.attn_backend, "init_metadata_for_capture", lambda key, batch: None)
    monkeypatch.setattr("backplane.executor.graph_runner.capture_graph", lambda fn, pool: (NoGraph(), fn()))
    monkeypatch.setattr("backplane.executor.graph_runner.global_graph_pool", lambda: None)
    graphs._capture_one(key)
    assert log == [("prepare_graph_batch", key, None), ("model", 4, ("graph", 4), key)]
    assert runner.model_ctx.forward is None  # nothing stays bound after the capture
    log.clear()
    # Replay with a stand-in for the captured graph: the contributor binds the real batch padded.
    monkeypatch.setattr(graphs.backend, "init_metadata_for_replay", lambda key, batch: None)
    graphs.graphs[key], graphs.outputs[key] = NoGraph(), ModelOutput(logits=torch.zeros(4, 8))
    assert graphs.replay(decode_batch(runner, 3)).logits.shape == (3, 8)
    assert log == [("prepare_graph_batch", key, 3)]  # no begin_forward: a replay runs no Python


def test_the_runner_binds_every_contributor_before_the_model_runs(plugin_set, monkeypatch):
    runner, log = tiny_runner(plugin_set), []
    runner.add_contributor(Recorder(log))
    record_model(runner, log, monkeypatch)
    reqs = [Req(i, [5 + i, 7, 9], SamplingParams()) for i in range(2)]
    for req in reqs:
        req.row = runner.req_to_token_pool.alloc()
    batch = build_extend_batch(reqs, [3, 3], runner.token_to_kv_pool, runner.req_to_token_pool)
    runner.forward(batch)
    assert log == [("begin_forward", 2), ("model", 2, ("eager", 2), None)]
    assert runner.model_ctx.forward is None


def test_registration_refuses_a_wrong_object_and_a_late_one(plugin_set):
    runner = tiny_runner(plugin_set)
    with pytest.raises(TypeError, match="expected a GraphContributor .* got object"):
        runner.add_contributor(object())
    runner.init_cuda_graphs()  # on CPU: no graphs, but the contributors are final from here on
    with pytest.raises(RuntimeError, match=r"add_contributor\(Recorder\) after init_cuda_graphs"):
        runner.add_contributor(Recorder([]))
    assert runner.contributors == []


def test_the_components_conform_to_their_protocols():
    assert issubclass(LoraManager, GraphContributor)
    assert issubclass(LoraManager, SchedulerParticipant)
    assert issubclass(TPDriver, ForwardRouter)
    assert issubclass(Recorder, GraphContributor)
    # The checks can fail: a class missing one method is not a contributor.
    assert not issubclass(type("Partial", (), {"begin_forward": lambda self, b: None}), GraphContributor)
    assert not issubclass(LoraManager, ForwardRouter)


def test_the_engine_wires_the_scheduler_and_the_runner_without_a_router():
    engine = Engine("tiny-llama", device="cpu", max_total_tokens=256)
    assert isinstance(engine.scheduler, RunningRequests)
    assert engine.runner.router is None and engine.runner.contributors == []  # no LoRA, one rank
    assert isinstance(TargetView(engine.runner), TargetRunner)  # what a spec algorithm may read is all there
    assert not isinstance(engine.scheduler, TargetRunner)


def test_a_tp_driver_refuses_forwards_before_its_workers_are_ready():
    driver = TPDriver.__new__(TPDriver)  # no workers spawned: only run()'s guard is exercised
    driver.closed, driver.ready, driver.failed = False, False, None
    with pytest.raises(RuntimeError, match="a forward before wait_ready"):
        driver.run(None, lambda batch: None)
