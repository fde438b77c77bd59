"""bench/prefill.py and bench/e2e.py on CPU: the cached-prefix probe hits what it says it hits, the
radix cache computes the ideal prompt tokens of a shared-prefix workload, and the floor's arithmetic."""

from __future__ import annotations

import pytest

from helpers_bench import CPU
from bench import e2e, prefill


def test_prefill_rows_and_the_cached_probe(tmp_path):
    rows, probes = prefill.main(["--models", "tiny-llama", "--backends", "torch_native", "--cases", "1x16", "2x8",
                                 "--probe", "40", "6", "--repeats", "1", "--no-compile", "--out", str(tmp_path), *CPU])
    assert [(r["batch_size"], r["length"]) for r in rows] == [(1, 16), (2, 8)]
    assert all(r["ratio"] == r["engine_ms"] / r["peer_ms"] and r["floor_ms"] > 0 for r in rows)
    hits = {name: [p["hit_tokens"] for p in runs] for name, runs in probes[0]["probes"].items()}
    assert hits == {"uncached": [0], "cached": [40], "floor": [45]}  # the floor computes its last token alone
    assert len(list(tmp_path.glob("prefill-tiny-llama-cpu-*.json"))) == 1


def test_the_radix_cache_computes_the_ideal_prompt_tokens(tmp_path):
    rows = e2e.main(["--model", "tiny-llama", "--backends", "torch_native", "--workloads", "shared-prefix", "distinct",
                     "--cache", "on", "off", "--requests", "6", "--groups", "2", "--prefix-shape", "40", "6", "3",
                     "--out", str(tmp_path), *CPU])
    prefilled = {(r["workload"], r["cache"]): r["prefill_tokens"] for r in rows}
    assert prefilled == {("shared-prefix", "on"): 2 * 40 + 6 * 6, ("shared-prefix", "off"): 6 * 46,
                         ("distinct", "on"): 6 * 46, ("distinct", "off"): 6 * 46}
    assert all(r["output_tokens"] == 6 * 3 and r["of_floor"] == pytest.approx(r["floor_s"] / r["seconds"]) for r in rows)


def test_the_floor_reads_weights_and_kv_per_step_and_does_the_prefill_flops():
    # one request of 2 input / 3 output tokens: 2 decode steps over 3 and 4 tokens of KV
    seconds = e2e.floor_seconds([(2, 3)], weights=100, kv_per_token=10, matmul_params=1000, tb_s=1e-12)
    assert seconds == pytest.approx(2 * 100 + 10 * 7 + 2 * 1000 * 2 / e2e.MATMUL_PEAK_FLOP_S)


def test_e2e_builds_an_engine_per_extend_graph_setting_and_sets_their_gain_side_by_side(monkeypatch):
    built = []

    def fake_engine(settings, fn):
        built.append(settings["disable_extend_graph"])
        return [{"workload": "fixed", "tok_s": 200.0 if settings["disable_extend_graph"] else 300.0, "prefill_tokens": 8}]

    monkeypatch.setattr(e2e.steps, "with_engine", fake_engine)
    ns = e2e.parse_args(["--extend-graph", "on", "off", "--backends", "triton"])
    rows = [r for g in ns.extend_graph for r in e2e.run_engine(ns, "triton", "on", 1.0, g)]
    assert built == [False, True] and [r["extend_graph"] for r in rows] == ["on", "off"]
    assert e2e.gains(rows, "extend_graph") == ["fixed triton (cache on): extend_graph on / off = 1.50x (prefill tokens 8 / 8)"]
    assert e2e.gains(rows, "cache") == []


def test_an_fp8_models_prefill_floor_counts_its_linears_at_the_fp8_peak():
    """At cf1fa80 the FP8 engine's floor used the bf16 peak, so its e2e run read 99% of a floor it
    could beat: the linears of an FP8 model run at the FP8 peak, its attention at bf16's."""
    from types import SimpleNamespace

    from bench import prefill
    from bench.timing import FP8_MATMUL_PEAK_FLOP_S, MATMUL_PEAK_FLOP_S, matmul_peak_flop_s

    def engine(name):
        choice = None if name is None else SimpleNamespace(spec=SimpleNamespace(name=name))
        return SimpleNamespace(runner=SimpleNamespace(quant_choice=choice))

    assert matmul_peak_flop_s(engine(None)) == MATMUL_PEAK_FLOP_S
    assert matmul_peak_flop_s(engine("fp8")) == FP8_MATMUL_PEAK_FLOP_S == 2 * MATMUL_PEAK_FLOP_S
    assert matmul_peak_flop_s(engine("int4-awq")) == MATMUL_PEAK_FLOP_S
    bf16 = e2e.floor_parts([(2, 3), (5, 1)], 100, 10, 1000, 1e-12)
    fp8 = e2e.floor_parts([(2, 3), (5, 1)], 100, 10, 1000, 1e-12, FP8_MATMUL_PEAK_FLOP_S)
    assert fp8["prefill"] == pytest.approx(bf16["prefill"] / 2) and fp8["decode"] == bf16["decode"]
    config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, hidden_size=64, head_dim=16, num_hidden_layers=2,
                             intermediate_size=128, vocab_size=100, tie_word_embeddings=False)
    whole, half_linears = prefill.floor_ms(config, 2, 8), prefill.floor_ms(config, 2, 8, FP8_MATMUL_PEAK_FLOP_S)
    attention = 4 * 4 * 16 * 8 * 9 / 2 * 2 * 2 / MATMUL_PEAK_FLOP_S * 1e3  # the causal attention's part stays at bf16
    assert half_linears == pytest.approx((whole - attention) / 2 + attention)


def test_e2e_crosses_quantization_with_the_kv_cache_dtype_and_sets_each_beside_bf16(monkeypatch):
    built = []

    def fake_engine(settings, fn):
        built.append((settings["quantization"], settings["kv_cache_dtype"]))
        speed = {("none", "auto"): 100.0, ("none", "fp8_e4m3"): 110.0, ("fp8", "auto"): 124.0, ("fp8", "fp8_e4m3"): 150.0}
        return [{"workload": "fixed", "tok_s": speed[built[-1]], "prefill_tokens": 8}]

    monkeypatch.setattr(e2e.steps, "with_engine", fake_engine)
    ns = e2e.parse_args(["--backends", "triton", "--quantization", "none", "fp8", "--kv-cache-dtype", "auto", "fp8_e4m3"])
    rows = [r for q in ns.quantization for kv in ns.kv_cache_dtype for r in e2e.run_engine(ns, "triton", "on", 1.0, "on", q, kv)]
    assert built == [("none", "auto"), ("none", "fp8_e4m3"), ("fp8", "auto"), ("fp8", "fp8_e4m3")]
    assert [r["kv_cache_dtype"] for r in rows] == ["auto", "fp8_e4m3", "auto", "fp8_e4m3"]
    assert e2e.quant_gains(rows, "none", "auto") == [
        "fixed triton: none + fp8_e4m3 KV / none = 1.10x tok/s", "fixed triton: fp8 / none = 1.24x tok/s",
        "fixed triton: fp8 + fp8_e4m3 KV / none = 1.50x tok/s"]
    with pytest.raises(SystemExit):
        e2e.parse_args(["--kv-cache-dtype", "fp16"])
