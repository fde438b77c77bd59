"""Settings resolved once (backplane.config) and built in one order (backplane.runtime)."""

from __future__ import annotations

import logging

import pytest

from backplane import Engine
from backplane.config import (DEFAULT_RUNNING_REQUESTS, SchedulerConfig, resolve_prefix_cache,
                              resolve_runtime)
from backplane.scheduler import Scheduler
from backplane.settings import EngineArgs


def args(**fields):
    return EngineArgs(model="tiny-llama", **fields)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_running_limit_defaults_per_device_and_is_the_pool_rows(device):
    config = resolve_runtime(args(), device)
    assert config.scheduler.max_running == DEFAULT_RUNNING_REQUESTS[device] == config.pool.req_rows
    assert resolve_runtime(args(max_running_requests=5), device).scheduler.max_running == 5


def test_draft_room_comes_from_the_draft_token_count():
    assert resolve_runtime(args(), "cpu").pool.spec_room == 0
    spec = resolve_runtime(args(speculative_algorithm="ngram", speculative_num_draft_tokens=6), "cpu")
    assert spec.pool.spec_room == 6
    assert spec.scheduler.overlap is False  # a speculative step reads its tokens before the next


def test_overlap_and_tp_are_resolved_from_the_flags():
    assert resolve_runtime(args(), "cpu").scheduler.overlap is True
    assert resolve_runtime(args(disable_overlap_schedule=True), "cpu").scheduler.overlap is False
    assert resolve_runtime(args(tp_size=2), "cuda").tensor_parallel.backend == "nccl"
    assert resolve_runtime(args(tp_size=2), "cpu").tensor_parallel.backend == "gloo"


def test_prefix_cache_off_names_why(caplog):
    assert resolve_prefix_cache(args()).enabled
    assert resolve_prefix_cache(args(disable_radix_cache=True)).disabled_reason == "--disable-radix-cache"
    with caplog.at_level(logging.WARNING):
        off = resolve_prefix_cache(args(), "drafts need the whole prompt")
    assert not off.enabled and "drafts need the whole prompt" in caplog.text


def test_bad_values_are_one_line():
    with pytest.raises(ValueError, match=r"SchedulerConfig.chunk_size: expected an integer >= 1, got 0"):
        SchedulerConfig(max_running=4, chunk_size=0)
    with pytest.raises(ValueError, match=r"device 'tpu': expected one of cuda, cpu"):
        resolve_runtime(args(), "tpu")


def test_the_engine_logs_its_runtime_once_and_its_parts_agree(caplog):
    with caplog.at_level(logging.INFO, logger="backplane.config"):
        engine = Engine("tiny-llama", device="cpu", max_total_tokens=512, max_running_requests=3)
    assert [r.message for r in caplog.records if r.name == "backplane.config"] == [engine.config.describe()]
    assert engine.scheduler.max_running == engine.config.scheduler.max_running == 3
    assert engine.runner.req_to_token_pool.size - 1 == engine.config.pool.req_rows  # one row for graph padding
    assert engine.scheduler.config is engine.config.scheduler


def test_the_old_scheduler_keywords_warn_and_still_work():
    engine = Engine("tiny-llama", device="cpu", max_total_tokens=512, max_running_requests=3)
    with pytest.warns(DeprecationWarning, match=r"pass Scheduler\(runner, SchedulerConfig"):
        sched = Scheduler(engine.runner, max_running=2, chunk_size=64, eos_token_ids=set(), detokenize=str)
    assert (sched.max_running, sched.chunk_size, sched.overlap) == (2, 64, False)
    with pytest.raises(TypeError, match=r"valid keywords: max_running, chunk_size, seed, overlap"):
        Scheduler(engine.runner, max_runing=2, chunk_size=64, eos_token_ids=set(), detokenize=str)


def test_build_runtime_keeps_its_order(monkeypatch):
    """runner, LoRA, speculation, ready(lora), then the graphs: each step sees the ones before."""
    import backplane.executor.model_runner as model_runner
    import backplane.lora.manager as lora_manager
    import backplane.speculative.factory as factory
    from backplane.runtime import build_runtime

    calls = []

    class Runner:
        def __init__(self, *a, **k):
            calls.append("runner")

        def init_cuda_graphs(self):
            calls.append("graphs")

    monkeypatch.setattr(model_runner, "ModelRunner", Runner)
    monkeypatch.setattr(lora_manager, "attach_lora", lambda runner: calls.append("lora") or "lora-manager")
    monkeypatch.setattr(factory, "build_spec_worker", lambda *a: calls.append(("spec", a[3])) or None)
    runtime = build_runtime(args(), None, ready=lambda lora: calls.append(("ready", lora)))
    assert calls == ["runner", "lora", ("spec", ["lora-manager"]), ("ready", "lora-manager"), "graphs"]
    assert runtime.participants == ["lora-manager"]
