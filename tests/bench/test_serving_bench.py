"""bench/serving.py on CPU: the load generator's pieces, and a smoke run (server, rates, offline Engine)."""

from __future__ import annotations

import json
import math
import statistics

from helpers_bench import CPU
from bench import serving
from bench import serving_client as client


def test_poisson_arrivals_are_seeded_with_mean_gap_one_over_rate():
    offsets = client.arrival_offsets(2001, 8.0, seed=3)
    assert offsets == client.arrival_offsets(2001, 8.0, seed=3) and offsets[0] == 0.0
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert all(g > 0 for g in gaps)
    assert abs(statistics.mean(gaps) - 1 / 8.0) < 0.1 / 8.0
    assert client.arrival_offsets(5, math.inf, seed=3) == [0.0] * 5


def test_percentile_interpolates_between_ranks():
    values = [4.0, 1.0, 3.0, 2.0, 10.0]
    assert client.percentile(values, 50) == statistics.median(values)
    assert client.percentile(values, 99) == 4.0 + (10.0 - 4.0) * 0.96
    assert client.percentile([7.0], 99) == 7.0 and client.percentile([], 50) is None


def test_workloads_share_lengths_but_not_tokens():
    a = client.make_workload(17, 64, 16, vocab=512, seed=0, token_seed=1)
    b = client.make_workload(17, 64, 16, vocab=512, seed=0, token_seed=2)
    assert [len(p) for p in a.prompts] == [len(p) for p in b.prompts] and a.output_lens == b.output_lens
    assert all(1 <= len(p) <= 64 for p in a.prompts) and all(1 <= n <= 16 for n in a.output_lens)
    assert all(x != y for x, y in zip(a.prompts, b.prompts))
    assert client.make_workload(5, 64, 4, 512, 0, 1).output_lens == [min(4, n) for n in a.output_lens[:5]]


def test_missing_serve_dependencies_fail_with_one_line(monkeypatch, capsys):
    monkeypatch.setattr(serving, "missing_dependencies", lambda: ["uvicorn"])
    assert serving.main(["--model", "tiny-llama", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "uvicorn" in err


def test_a_bad_model_is_one_line_before_any_server(capsys):
    assert serving.main(["--model", "no-such-model", *CPU]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("bench.serving: --model 'no-such-model': expected a local")


def test_a_server_that_dies_at_startup_is_reported_with_its_log(tmp_path, capsys):
    # NOTE: --engine-in-thread: the server dies the same way (tests/server/test_engine_process.py checks
    # that a startup error reads the same in both modes) without first starting an engine process (~3 s)
    code = serving.main(["--model", "tiny-llama", *CPU, "--out", str(tmp_path), "--", "--attention-backend", "nope",
                         "--engine-in-thread"])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("bench.serving: backplane serve exited with code 2 before /health answered")
    (log,) = tmp_path.glob("serving-tiny-llama-cpu-*-server.log")  # kept beside where the result would be
    assert f"({log})" in err and "nope" in err.splitlines()[-1] and "nope" in log.read_text()
    assert list(tmp_path.glob("*.json")) == []


def test_smoke_run_on_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the server subprocess: tiny models want one thread
    code = serving.main(["--model", "tiny-llama", *CPU, "--num-prompts", "6", "--request-rates", "4,inf",
                         "--max-input-len", "32", "--max-output-len", "8", "--warmup", "2", "--probes", "2",
                         "--out", str(tmp_path), "--", "--attention-backend", "torch_native", "--max-total-tokens", "4096"])
    assert code == 0, capsys.readouterr()
    (path,) = tmp_path.glob("serving-tiny-llama-cpu-*.json")
    assert path.with_name(path.stem + "-server.log").stat().st_size > 0
    report = json.loads(path.read_text())
    assert report["meta"]["card"] == "cpu"
    assert list(report["rates"]) == ["4", "inf"] and report["server_exit_code"] == 0
    for row in report["rates"].values():
        assert row["completed"] == row["requests"] and row["short_outputs"] == 0 and row["errors"] == []
        assert row["ttft_ms"]["p50"] > 0 and row["itl_ms"]["p99"] >= row["itl_ms"]["p50"] and row["output_tok_s"] > 0
    assert report["rates"]["4"]["requests"] == 6  # min(num_prompts, max(8, rate x max_duration))
    offline = report["offline"]
    assert offline["output_tokens"] == report["rates"]["inf"]["output_tokens"]
    assert offline["prefill_probe"]["median_ms"] > 0
    assert set(report["targets"]) == {"saturation", "low_rate_ttft"}
    assert report["targets"]["low_rate_ttft"]["rate"] == "4"
    table = capsys.readouterr().out.strip().splitlines()
    assert table[-1].startswith("TTFT at rate 4") and table[-2].startswith("saturation")
