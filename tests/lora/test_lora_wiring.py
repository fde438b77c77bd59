"""How the LoraManager is wired into an engine: a contributor of the runner (no hook hidden on the
model), bound before every model call, reading the scheduler's running requests for eviction."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from backplane import Engine, SamplingParams
from backplane.distributed.lora_sync import LoraSlotTable, pack_lora
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
    assert isinstance(manager, LoraSlotTable)
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
        seen.append((batch.lora_info is not None, runtime.batch_info is batch.lora_info))
        return model_forward(batch)

    monkeypatch.setattr(engine.runner.model, "forward", forward)
    for adapter in ("all7_r4", None, "kogu_r2", None):
        out = engine.generate(input_ids=[[5, 17, 33, 2]], sampling_params=GREEDY, lora=adapter)[0]
        assert out.error is None
    assert {with_lora for with_lora, _ in seen} == {True, False}
    assert all(bound for _, bound in seen), seen


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


def test_pack_lora_carries_the_resident_slots(world):
    engine = make_engine(world)
    manager = engine.lora_manager
    slots = manager.acquire(["kogu_r2", None])
    batch = SimpleNamespace(lora_info=manager.info.update_([3, 1], slots))
    msg = pack_lora(manager, batch)
    assert msg.slot_of == {"kogu_r2": slots[0]} and msg.slots == slots and msg.seg_lens == [3, 1]
    assert pack_lora(manager, SimpleNamespace(lora_info=None)) is None
