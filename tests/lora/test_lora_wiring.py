"""How the LoraManager is wired into an engine: a contributor of the runner (no hook hidden on the
model), bound before every model call, reading the scheduler's running requests for eviction."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from backplane import Engine, SamplingParams
from backplane.contracts.lora_batch import LoraSegments
from backplane.contracts.protocols import GraphContributor, SchedulerParticipant
from lora_helpers import make_lora_world

GREEDY = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return make_lora_world(tmp_path_factory.mktemp("lora_wiring"))


def make_engine(world, **kwargs) -> Engine:
    settings = dict(device="cpu", dtype="float32", max_total_tokens=1024, max_running_requests=8,
                    lora_paths=world.lora_paths(), lora_backend="torch_native", max_loras_per_batch=2)
    return Engine(str(world.base_dir), **{**settings, **kwargs})


def test_the_manager_is_a_contributor_and_the_model_has_no_hooks(world):
    engine = make_engine(world)
    manager = engine.lora_manager
    assert isinstance(manager, GraphContributor) and isinstance(manager, SchedulerParticipant)
    assert engine.runner.contributors == [manager]
    assert engine.scheduler.participants == [manager]
    assert manager.running_source is engine.scheduler
    model = engine.runner.model
    assert [name for name, m in model.named_modules() if m._forward_pre_hooks or m._forward_hooks] == []
    assert not torch.nn.modules.module._global_forward_pre_hooks


def test_every_model_call_runs_with_its_batch_bound(world, monkeypatch):
    """The runner calls begin_forward before the model: each call sees its own batch's LoRA info
    (a base-only batch after a LoRA one must not keep the adapter's segments)."""
    engine = make_engine(world)
    runtime, seen = engine.lora_manager.runtime, []
    model_forward = engine.runner.model.forward

    def forward(batch):
        segments, bound = batch.plugin_inputs.get("lora"), engine.runner.model_ctx.forward.binding("lora")
        seen.append((segments is not None, runtime.batch_info is bound and (bound is None) == (segments is None)))
        return model_forward(batch)

    monkeypatch.setattr(engine.runner.model, "forward", forward)
    for adapter in ("all7_r4", None, "kogu_r2", None):
        out = engine.generate(input_ids=[[5, 17, 33, 2]], sampling_params=GREEDY, lora=adapter)[0]
        assert out.error is None
    assert {with_lora for with_lora, _ in seen} == {True, False}
    assert all(bound for _, bound in seen), seen
    assert runtime.batch_info is None  # nothing stays bound between forwards


def test_running_requests_keep_their_adapters_loaded(world):
    engine = make_engine(world)
    manager = engine.lora_manager
    manager.acquire(["all7_r4"])
    manager.acquire(["qv_down_r8"])  # both slots taken; all7_r4 is the least recently used
    running = SimpleNamespace(running=[])
    manager.bind_running(running)
    running.running.append(SimpleNamespace(lora="all7_r4"))  # read live, at each acquire
    manager.acquire(["kogu_r2"])
    assert set(manager.resident_slots()) == {"all7_r4", "kogu_r2"}  # the unpinned one went
    running.running.clear()
    manager.acquire(["qv_down_r8"])
    assert set(manager.resident_slots()) == {"kogu_r2", "qv_down_r8"}
    with pytest.raises(TypeError, match="expected a RunningRequests"):
        manager.bind_running(object())


def test_a_batch_describes_its_segments_and_a_second_rank_mirrors_the_slots(world):
    """prepare_batch puts host data in plugin_inputs (what tensor parallelism ships as it is); a
    manager that did not choose the slots (a worker) loads them from that description."""
    engine, worker = make_engine(world), make_engine(world)
    manager = engine.lora_manager
    reqs = [SimpleNamespace(lora="kogu_r2"), SimpleNamespace(lora=None)]
    batch = SimpleNamespace(plugin_inputs={}, extend_seq_lens_cpu=torch.tensor([3, 1]), tokens_per_request=2)
    manager.prepare_batch(batch, reqs)
    segments = batch.plugin_inputs["lora"]
    slot = manager.resident_slots()["kogu_r2"]
    assert segments == LoraSegments((3, 1), (slot, 0), (("kogu_r2", slot),))
    binding = worker.lora_manager.begin_forward(batch)["lora"]
    assert worker.lora_manager.mirrored == {slot: "kogu_r2"}
    assert binding.seg_lens_cpu[:2].tolist() == [3, 1] and binding.weight_indices_cpu[:2].tolist() == [slot, 0]
    for mine, theirs in zip(manager.layers, worker.lora_manager.layers):
        torch.testing.assert_close(theirs.lora_b[slot], mine.lora_b[slot])
    manager.prepare_batch(batch, [SimpleNamespace(lora=None)] * 2)
    assert "lora" not in batch.plugin_inputs and worker.lora_manager.begin_forward(batch) == {"lora": None}
