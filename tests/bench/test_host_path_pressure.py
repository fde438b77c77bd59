"""bench/host_path.py --pressure: a decode step's host ms on a full KV pool, where the timed requests'
prefill and decode steps evict from the radix cache to find their slots."""

from __future__ import annotations

import json

from helpers_bench import CPU
from backplane import Engine
from backplane.scheduler.radix import RadixTree
from bench import host_path

SMALL = ["--fresh", "--repeat", "--decode-context", "0", "--pressure", "2", "5", "--pressure-prompt", "7",
         "--pressure-steps", "3", "--rounds", "1", *CPU]


def test_pressure_rows_alone(tmp_path):
    got = host_path.main([*SMALL, "--out", str(tmp_path)])
    assert [r["scenario"] for r in got["rows"]] == ["pressure@2", "pressure@5"]
    for row, bs in zip(got["rows"], (2, 5)):
        assert row["batch_size"] == bs and row["requests"] == 1 and row["computed"] is None
        assert row["new"] == 4 and row["prefix"] == 7 and len(row["round_medians_ms"]) == 1
    (path,) = tmp_path.glob("host-path-tiny-llama-cpu-*.json")
    assert [r["scenario"] for r in json.loads(path.read_text())["rows"]] == ["pressure@2", "pressure@5"]


def test_the_timed_requests_evict_in_prefill_and_decode(monkeypatch):
    ns = host_path.parse_args(SMALL)
    settings = host_path.pressure_settings(ns)
    assert settings["max_running_requests"] == 5 and settings["max_total_tokens"] == 4 * 5 * (7 + 1 + 3)
    engine = Engine(**settings)
    calls: list[int] = []
    evict = RadixTree.evict
    monkeypatch.setattr(RadixTree, "evict", lambda tree, n: calls.append(n) or evict(tree, n))
    try:
        with host_path.stub_model(engine):
            host_path.fill_cache(engine, ns, seed=host_path.FILL_SEEDS)
            assert engine.runner.token_to_kv_pool.num_free < 7 + 1 + 3  # the cache holds the rest
            calls.clear()
            prompts = host_path.workload.prompts([7] * 5, int(engine.runner.hf_config.vocab_size), seed=2)
            host_path.steps.timed_generate(engine, prompts, host_path.steps.greedy(1 + 3))
    finally:
        engine.shutdown()
    # the prefill asks for room, then decode steps (5 slots each; a leaf of up to 11 tokens freed at a time)
    assert len(calls) >= 2 and calls[0] > 5 * 7 - 11 and all(0 < n <= 5 for n in calls[1:])
