"""bench/host_path.py on CPU: the engine's host cost per request with a stub forward, per scenario,
with its phases, the host reads of tensors and cProfile's top functions; the stub only stands in
for the model while the benchmark runs."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from helpers_bench import CPU
from bench import host_path

SMALL = ["--fresh", "16", "--repeat", "16", "--decode-context", "16", "--decode-steps", "3", "--rounds", "2",
         "--requests", "3", "--profile", "5", *CPU]


def test_each_scenario_has_its_median_phases_reads_and_profile(tmp_path, capsys):
    got = host_path.main([*SMALL, "--out", str(tmp_path)])
    fresh, repeat, decode = got["rows"]
    assert decode["scenario"] == "decode@16" and decode["computed"] is None and "phases" not in decode
    assert decode["requests"] == 6 and len(decode["round_medians_ms"]) == 2 and decode["median_ms"] > 0
    assert (fresh["scenario"], fresh["computed"], repeat["scenario"], repeat["computed"]) == (
        "fresh-16", "16", "repeat-16", "1")  # the repeated prompt computed its last token only
    for row in (fresh, repeat):
        assert row["requests"] == 6 and len(row["round_medians_ms"]) == 2
        assert row["min_round_ms"] <= statistics.median(row["round_medians_ms"]) <= row["max_round_ms"]
        assert 0 < row["median_ms"] < 50
        phases = {name: (us, calls) for name, us, calls in row["phases"]}
        assert {"requests", "admission", "build batch", "runner forward (stub model)", "sample", "finish",
                "radix release", "output", "loop"} <= set(phases)
        assert phases["runner forward (stub model)"][1] == 1 and phases["admission"][1] == 2  # two steps
        assert all(us > 0 for name, (us, _) in phases.items() if name != "loop")
        assert any("core/scheduler/overlap.py" in site and name == "tolist" for name, _, site, _ in row["host_reads"])
        assert len(row["top_python"]) == 5 and all(us >= 0 for _, us, _ in row["top_python"])
    (path,) = tmp_path.glob("host-path-tiny-llama-cpu-*.json")
    doc = json.loads(path.read_text())
    assert "out" not in doc["args"] and str(tmp_path) not in path.read_text()  # no machine paths in a result
    assert doc["meta"]["card"] == "cpu" and [r["median_ms"] for r in doc["rows"]] == [
        fresh["median_ms"], repeat["median_ms"], decode["median_ms"]]
    out = capsys.readouterr().out.rstrip().splitlines()  # the table comes last: title, header, three rows
    assert out[-5].startswith("host ms per request outside the model") and out[-1].split()[0] == "decode@16"


def test_the_stub_stands_in_for_the_model_only_within_the_block():
    from backplane import Engine

    engine = Engine("tiny-llama", device="cpu", max_total_tokens=256)
    params = host_path.steps.greedy(2)
    real = engine.generate(input_ids=[[5, 6, 7]], sampling_params=params)[0].token_ids
    with host_path.stub_model(engine):
        engine.flush_cache()
        stub = engine.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params=params)
        logits = engine.runner.model.forward.logits
        rows = [int(logits[i].argmax()) for i in (0, 1)]  # one prefill batch, then one decode batch
        assert [o.token_ids for o in stub] == [[rows[0]] * 2, [rows[1]] * 2]
    engine.flush_cache()
    assert "forward" not in vars(engine.runner.model)
    assert engine.generate(input_ids=[[5, 6, 7]], sampling_params=params)[0].token_ids == real


def test_host_reads_name_each_read_and_each_cuda_synchronisation_with_its_call_site():
    from backplane.scheduler.overlap import LaunchedStep

    reads = host_path.HostReads()
    with reads:
        LaunchedStep.launch([], torch.tensor([3]), torch.tensor([-0.5]))  # CPU: read at once, in launch
        if not torch.cuda.is_available():
            with pytest.raises((AssertionError, RuntimeError)):
                torch.cuda.synchronize()  # no CUDA here: counted, then refused
    sites = {(name, device): site for name, device, site in reads.sites}
    assert sites[("tolist", "cpu")].startswith("core/scheduler/overlap.py:") and sites[("tolist", "cpu")].endswith("(launch)")
    assert reads.sites[("tolist", "cpu", sites[("tolist", "cpu")])] == 2  # tokens and log-probabilities
    if not torch.cuda.is_available():
        assert reads.sites[("cuda.synchronize", "cuda", "?")] == 1  # called from outside the project
    assert torch.cuda.synchronize is not None and "call" not in torch.cuda.synchronize.__name__  # patch undone


def test_device_ops_counts_device_operations_and_pageable_copies_by_kind():
    """bench.host_path's DeviceOps: every operation touching a device tensor (meta stands in for one
    here), views marked, a copy from pageable host memory marked; host-only operations not counted."""
    from bench.host_path import DeviceOps

    class MetaIsDevice(DeviceOps):
        HOST = ("cpu",)

    ops = MetaIsDevice()
    host = torch.arange(4)
    with ops:
        dev = torch.empty(4, device="meta")
        dev.copy_(host)
        dev[1:].add_(1)
        host * 2
    counts = {label: k for (label, _site), k in ops.sites.items()}
    assert counts == {"empty": 1, "copy_ (pageable h2d)": 1, "slice (view)": 1, "add_": 1}, counts
