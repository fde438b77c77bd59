"""The engine chooses its CPU threads: one for a model whose weight matrices are too small to split
(tiny-llama: two threads ran it 1.4-60x slower than one on a 2-core machine with other work), the
cores for a larger one, and --cpu-threads or OMP_NUM_THREADS when given; `generate` says which."""

from __future__ import annotations

import types

import pytest
import torch

from backplane import Engine
from backplane.cli import main
from backplane.config import largest_weight_matrix
from backplane.models.presets import get_preset
from backplane.settings import SMALL_MATRIX, EngineArgs, resolve_cpu_threads


@pytest.fixture(autouse=True)
def _keep_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_small_model_gets_one_thread_a_large_one_the_cores(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    small = largest_weight_matrix(get_preset("tiny-llama"))
    large = largest_weight_matrix(get_preset("llama-3.2-1b"))
    assert small < SMALL_MATRIX <= large
    assert resolve_cpu_threads(EngineArgs(), small)[0] == 1
    assert resolve_cpu_threads(EngineArgs(), large) == (4, "4 cores available to this process")
    assert resolve_cpu_threads(EngineArgs(cpu_threads=3), small) == (3, "--cpu-threads")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert resolve_cpu_threads(EngineArgs(), small) == (2, "OMP_NUM_THREADS")


def test_the_engine_sets_them_and_generate_says_so(capsys):
    torch.set_num_threads(2)
    engine = Engine("tiny-llama", device="cpu", max_total_tokens=256)
    assert torch.get_num_threads() == 1 and engine.threads.startswith("CPU threads: 1 (a small model")
    assert main(["generate", "--model", "tiny-llama", "--device", "cpu", "--max-new-tokens", "2",
                 "--cpu-threads", "2"]) == 0
    assert "CPU threads: 2 (--cpu-threads)" in capsys.readouterr().out and torch.get_num_threads() == 2


def test_a_tp_size_the_heads_do_not_divide_is_refused_before_any_worker(monkeypatch):
    started = []
    monkeypatch.setattr("backplane.distributed.driver.start_tensor_parallel",
                        lambda *a, **k: started.append(1) or types.SimpleNamespace())
    with pytest.raises(ValueError, match="tp"):
        Engine("tiny-llama", device="cpu", tp_size=3)
    assert started == []

