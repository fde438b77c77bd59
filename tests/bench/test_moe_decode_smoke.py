"""bench/moe_decode.py and bench/peer_moe.py on CPU (a tiny Qwen3-MoE, fp32, no compile): the whole
script runs end to end and writes its result; the peer on the engine's own weights computes the
engine's function (same greedy tokens, same log-probabilities), a peer that drops its MoE is caught
by the check, the floor counts the active weights only, and other MoE models are refused in one line."""

from __future__ import annotations

import json
import math

import pytest
import torch

from helpers_bench import CPU
from bench import moe_decode, peer_moe

TINY = ["--model", "tiny", "--backend", "torch_native", "--batch-sizes", "1", "3", "--prompt", "8", "--steps", "3",
        "--check-steps", "3", "--rounds", "1", "--no-compile", *CPU]


def test_a_run_checks_the_peer_then_times_both_and_writes_its_result(tmp_path, capsys):
    rows = moe_decode.main([*TINY, "--out", str(tmp_path)])
    assert [r["batch_size"] for r in rows] == [1, 3]
    for r in rows:
        checked = r["check_result"]
        assert checked["agree"] == 3 * r["batch_size"] and checked["tie"] == checked["mismatch"] == 0, checked
        assert checked["max_logprob_diff"] < 1e-4 and r["check"] == "ok"
        assert r["peer_ms"] > 0 and math.isfinite(r["engine_ms"]) and r["ratio"] == r["engine_ms"] / r["peer_ms"]
        assert r["replay_ms"] is None  # no graphs on CPU
    assert rows[0]["step_floor"] == rows[0]["engine_ms"] / rows[0]["floor_ms"] and rows[1]["floor_ms"] is None
    (path,) = tmp_path.glob("moe-decode-tiny-cpu-*.json")
    doc = json.loads(path.read_text())
    assert doc["meta"]["card"] == "cpu" and doc["config"]["architectures"] == ["Qwen3MoeForCausalLM"]
    assert doc["backends"]["moe"]["backend"] == "torch_native" and set(doc["verdicts"]) == {
        "ratio_bs1", "ratio_bs3", "step_floor_bs1", "checks"} and doc["verdicts"]["checks"] == "ok"
    floor = doc["floor"]
    assert floor["floor_ms"] == pytest.approx((floor["weight_bytes"] + floor["kv_bytes"]) / (doc["copy_tb_s"] * 1e9))
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-3].split()[:3] == ["bs", "engine", "ms"]  # the table comes last


def test_a_peer_without_its_moe_is_caught_by_the_check(tmp_path, monkeypatch):
    monkeypatch.setattr(peer_moe.PeerQwen3Moe, "moe", lambda self, i, x: torch.zeros_like(x))
    rows = moe_decode.main([*TINY, "--out", str(tmp_path)])
    assert sum(r["check_result"]["mismatch"] for r in rows) > 0 and "MISMATCH" in rows[-1]["check"]
    assert min(r["check_result"]["max_logprob_diff"] for r in rows) > 1e-2
    (path,) = tmp_path.glob("moe-decode-tiny-cpu-*.json")
    assert json.loads(path.read_text())["verdicts"]["checks"] == "MISMATCH"


def test_the_compiled_peer_traces_whole_and_still_agrees(tmp_path, monkeypatch):
    """build's torch.compile call with aot_eager in place of Inductor + CUDA graphs: one graph (fullgraph)
    of the decode step, checked against the engine like the eager peer."""
    compile_ = torch.compile
    calls = []

    def aot_eager(model, mode, fullgraph, dynamic):
        calls.append((mode, fullgraph, dynamic))
        return compile_(model, backend="aot_eager", fullgraph=fullgraph, dynamic=dynamic)

    monkeypatch.setattr(torch, "compile", aot_eager)
    no_compile = [a for a in TINY if a != "--no-compile"]
    rows = moe_decode.main([*no_compile, "--batch-sizes", "2", "--out", str(tmp_path)])
    assert calls == [("reduce-overhead", True, False)]
    assert rows[0]["check_result"]["agree"] == 6 and rows[0]["check_result"]["max_logprob_diff"] < 1e-4


def _tiny_model(**overrides):
    import transformers

    from backplane.models import ModelContext
    from backplane.plugins.model_moe import model as moe

    keys = {k: v for k, v in moe_decode.MODELS["tiny"].items() if k not in ("architectures", "model_type", "torch_dtype")}
    config = transformers.Qwen3MoeConfig(**{**keys, **overrides})
    return moe.Qwen3MoeForCausalLM(config, ModelContext())


def test_the_floor_reads_the_chosen_experts_one_embedding_row_and_everything_else_whole():
    model, c = _tiny_model(), moe_decode.MODELS["tiny"]
    h, inter, hd, layers = c["hidden_size"], c["moe_intermediate_size"], c["head_dim"], c["num_hidden_layers"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    per_layer = (h * (q + 2 * kv) + q * h + 2 * hd + 2 * h + c["num_experts"] * h
                 + c["num_experts_per_tok"] * 3 * inter * h)
    params = layers * per_layer + h + c["vocab_size"] * h + h  # one embedding row, the lm_head, the final norm
    assert moe_decode.bs1_weight_bytes(model) == 4 * params
    assert moe_decode.kv_bytes(model, 10) == 2 * layers * kv * 10 * 4


def test_the_peer_refuses_a_moe_model_it_does_not_reproduce():
    with pytest.raises(ValueError, match=r"^the MoE peer: expected a Qwen3MoeForCausalLM with every layer's mlp a "
                                         r"FusedMoE with renormalised top-k and no shared expert"):
        peer_moe.PeerQwen3Moe(_tiny_model(mlp_only_layers=[1]), 1, 16)
    with pytest.raises(ValueError, match="renormalised top-k"):
        peer_moe.PeerQwen3Moe(_tiny_model(norm_topk_prob=False), 1, 16)


def test_the_benchmark_answers_help_and_is_a_group_of_bench_run(capsys):
    from bench import run

    with pytest.raises(SystemExit) as stop:
        moe_decode.main(["--help"])
    assert stop.value.code == 0 and "--check-steps" in capsys.readouterr().out
    (job,) = run.GROUPS["moe-decode"]
    assert job.argv[:2] == ("-m", "bench.moe_decode") and moe_decode.parse_args(list(job.argv[2:])).batch_sizes == [1, 8, 32]


def test_custom_ops_reach_the_engine_and_the_result(tmp_path):
    """--custom-ops OP=IMPL ... is the engine's --custom-ops (default none), recorded in the JSON's args;
    the engine's choice shows in its backends."""
    assert moe_decode.parse_args([]).custom_ops == []
    ns = moe_decode.parse_args(["--custom-ops", "moe_route=triton", "rms_norm=native"])
    assert moe_decode.engine_settings(ns, tmp_path)["custom_ops"] == ["moe_route=triton", "rms_norm=native"]
    moe_decode.main([*TINY, "--batch-sizes", "1", "--custom-ops", "moe_route=native", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("moe-decode-tiny-moe_route-native-cpu-*.json")
    doc = json.loads(path.read_text())
    assert doc["args"]["custom_ops"] == ["moe_route=native"] and doc["backends"]["custom_ops"]["moe_route"] == "native"


def test_runs_with_other_custom_ops_write_apart():
    """bench.run's moe-route-ab runs the bench twice into one folder: the result files must differ."""
    from bench import moe_decode

    plain = moe_decode.result_subject(moe_decode.parse_args([]))
    fused = moe_decode.result_subject(moe_decode.parse_args(["--custom-ops", "moe_route=triton"]))
    assert plain == "qwen3-30b-a3b" and fused != plain and "moe_route" in fused
