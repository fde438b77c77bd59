"""bench/compile_speed.py on CPU: alternating repeats, medians over them, and the table."""

from __future__ import annotations

import json

import pytest

from helpers_bench import load_bench

compile_speed = load_bench("compile_speed")


def test_repeats_alternate_and_the_ratio_is_of_medians(monkeypatch, tmp_path, capsys):
    order = []
    # step ms per (compile, repeat): one slow plain sample must not move the plain median much
    steps = {(False, 0): 2.0, (True, 0): 1.8, (False, 1): 2.2, (True, 1): 1.6, (False, 2): 9.0, (True, 2): 1.7}

    def fake(ns, backend, compile_):
        repeat = sum(1 for b, c in order if b == backend and c == compile_)
        order.append((backend, compile_))
        ms = steps[(compile_, repeat)]
        return {"backend": backend, "compile": compile_, "mode": "graph", "decode_step_ms": {1: ms, 8: 2 * ms},
                "capture_s": 80.0 - 60 * repeat if compile_ else 5.0, "graph_batch_sizes": [1, 2, 4, 8],
                "graph_memory_mb": 1.0, "graph_mode_limits": {}, "wall_s": 1.0}

    monkeypatch.setattr(compile_speed, "bench_once", fake)
    out = tmp_path / "c.json"
    assert compile_speed.main(["--backends", "triton", "--batch-size", "1", "8", "--repeats", "3",
                               "--out", str(out)]) == 0
    assert order == [("triton", False), ("triton", True)] * 3
    report = json.loads(out.read_text())
    row1 = next(r for r in report["rows"] if r["batch_size"] == 1)
    assert row1["graph_ms"] == pytest.approx(2.2) and row1["compiled_graph_ms"] == pytest.approx(1.7)
    assert row1["ratio"] == pytest.approx(1.7 / 2.2) and row1["samples"] == [3, 3]
    assert [r["repeat"] for r in report["runs"]] == [0, 0, 1, 1, 2, 2]
    text = capsys.readouterr().out
    assert text.count("(warm cache)") == 2 and "80.0" in text


def test_repeats_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        compile_speed.parse_args(["--repeats", "0"])
    assert "--repeats: expected a positive number of runs, got 0" in capsys.readouterr().err
