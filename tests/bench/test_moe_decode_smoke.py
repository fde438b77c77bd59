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


def test_profile_splits_a_step_into_groups_that_add_up(tmp_path, capsys):
    """--profile 1 on CPU: the profiler sees host ops only, which stand for the kernels; every one
    lands in exactly one group, so the groups add up to the profiled total, and the floor column
    divides the group's bs-1 bytes by the layers."""
    rows = moe_decode.main([*TINY, "--batch-sizes", "1", "--profile", "1", "--out", str(tmp_path)])
    profile, groups = rows[0]["profile"], {r["group"]: r for r in rows[0]["per_layer"]}
    assert list(groups) == [*moe_decode.GROUP_NAMES, "all kernels", "idle or host"]
    assert profile["kernel_ms"] > 0 and len(profile["kernels"]) > len(profile["top_kernels"])
    parts = [groups[g] for g in moe_decode.GROUP_NAMES]
    assert sum(r["ms"] for r in parts) == pytest.approx(profile["kernel_ms"], rel=1e-9)
    assert sum(r["launches"] for r in parts) == pytest.approx(profile["launches"], rel=1e-9)
    assert sum(r["distinct"] for r in parts) == len(profile["kernels"])
    assert groups["all kernels"]["ms"] == pytest.approx(profile["kernel_ms"])
    assert groups["idle or host"]["ms"] == pytest.approx(profile["wall_ms"] - profile["kernel_ms"])
    assert groups["dense gemm"]["ms"] > 0 and groups["router"]["ms"] > 0  # aten::mm; the router's topk
    layers, c = 2, moe_decode.MODELS["tiny"]
    assert groups["router"]["us_per_layer"] == pytest.approx(groups["router"]["ms"] * 1e3 / layers)
    expert_w2 = c["num_experts_per_tok"] * c["hidden_size"] * c["moe_intermediate_size"] * 4  # fp32 on CPU
    doc = json.loads(next(tmp_path.glob("moe-decode-tiny-cpu-*.json")).read_text())
    assert groups["moe down"]["floor_us_per_layer"] == pytest.approx(expert_w2 / (doc["copy_tb_s"] * 1e6))
    assert groups["all kernels"]["floor_us_per_layer"] == pytest.approx(doc["floor"]["floor_ms"] * 1e3 / layers)
    assert doc["rows"][0]["per_layer"][0]["group"] == "moe align" and doc["moe_table"] is None  # torch_native
    out = capsys.readouterr().out
    assert "bs 1: kernels by group, per layer" in out and "all kernels" in out


def test_kernel_groups_of_the_cuda_step():
    """The names the bs-1 step's kernels have on CUDA (moe_triton, ops_triton, attention_triton, cuBLAS, PyTorch)."""
    names = {
        "_align_single_kernel": "moe align", "_gate_up_kernel": "moe gate_up", "_down_kernel": "moe down",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<c10::BFloat16, at::native::func_wrapper_t<float, "
        "at::native::sum_functor<c10::BFloat16, float, float>::operator()": "moe sum",
        "_moe_route_kernel": "router", "void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>": "router",
        "_decode_split_kernel": "attention", "_decode_merge_kernel": "attention",
        "nvjet_tst_64x8_64x16_4x1_v_bz_TNT": "dense gemm", "void gemv2T_kernel_val<int, int, __nv_bfloat16>": "dense gemm",
        "_rms_norm_kernel": "norms and elementwise", "_rotary_kv_write_kernel": "norms and elementwise",
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<int>>": "norms and elementwise",
        "_greedy_sample_kernel": "other", "Memcpy DtoD (Device -> Device)": "other",
    }
    assert {name: moe_decode.kernel_group(name) for name in names} == names


def test_per_layer_divides_by_the_layers_and_sets_the_floor_beside():
    profile = {"kernels": [("_gate_up_kernel", 0.96, 48.0), ("nvjet_x", 0.48, 144.0), ("_greedy_sample_kernel", 0.01, 1.0)],
               "kernel_ms": 1.45, "wall_ms": 2.0}
    rows = {r["group"]: r for r in moe_decode.per_layer(profile, 48, {"moe gate_up": 480e6, "attention": 0}, 1.0)}
    assert rows["moe gate_up"]["us_per_layer"] == pytest.approx(20.0) and rows["moe gate_up"]["launches_per_layer"] == 1
    assert rows["moe gate_up"]["floor_us_per_layer"] == pytest.approx(10.0) and rows["moe gate_up"]["x_floor"] == pytest.approx(2.0)
    assert rows["dense gemm"]["launches_per_layer"] == 3 and rows["dense gemm"]["floor_us_per_layer"] is None
    assert rows["idle or host"]["ms"] == pytest.approx(0.55) and rows["all kernels"]["share"] == pytest.approx(0.725)
    assert rows["moe gate_up"]["top"] == "_gate_up_kernel" and rows["moe align"]["ms"] == 0


def test_moe_configs_reach_the_engine_and_keep_the_result_apart(tmp_path, monkeypatch):
    """--moe-configs PATH is the engine's --triton-moe.configs; the result file is named after it."""
    ns = moe_decode.parse_args(["--moe-configs", "out/moe_triton_configs.json"])
    assert moe_decode.engine_settings(ns, tmp_path)["plugin_options"] == {"triton-moe": {"configs": "out/moe_triton_configs.json"}}
    assert moe_decode.engine_settings(moe_decode.parse_args([]), tmp_path)["plugin_options"] is None
    assert moe_decode.result_subject(ns) == "qwen3-30b-a3b-configs-moe_triton_configs"
    seen = []
    monkeypatch.setattr(moe_decode, "moe_table", lambda engine: seen.append(engine.args.options_for("triton-moe").configs))
    moe_decode.main([*TINY, "--batch-sizes", "1", "--moe-configs", str(tmp_path / "t.json"), "--out", str(tmp_path)])
    assert seen == [str(tmp_path / "t.json")] and len(list(tmp_path.glob("moe-decode-tiny-configs-t-cpu-*.json"))) == 1
    with pytest.raises(SystemExit):
        moe_decode.parse_args(["--batch-sizes", "1", "--profile", "8"])  # not a measured size


def test_the_moe_bs1_group_tunes_then_runs_both_tables_one_after_another():
    from backplane.plugins.moe_triton import tune
    from bench import run

    jobs = run.GROUPS["moe-bs1"]
    assert [j.argv[1] for j in jobs] == ["backplane.plugins.moe_triton.tune", "bench.moe_decode", "bench.moe_decode"]
    assert not any(j.together for j in jobs)  # the ~61 GB model once at a time
    tuned = tune.parse_args(list(jobs[0].argv[2:]))
    assert tuned.out == "{out}/moe_triton_configs.json" and tuple(tuned.tokens) == tune.DECODE_TOKENS
    assert tuned.shapes == ["qwen3-30b-a3b"] and tuned.budget <= 180
    bundled, fresh = (moe_decode.parse_args(list(j.argv[2:])) for j in jobs[1:])
    assert bundled.moe_configs is None and fresh.moe_configs == tuned.out
    for ns in (bundled, fresh):
        assert ns.batch_sizes == [1] and ns.rounds == 5 and ns.profile == [1]
    assert moe_decode.result_subject(bundled) != moe_decode.result_subject(fresh)


def test_the_one_token_layout_ab_reaches_moe_triton_and_keeps_the_results_apart(tmp_path):
    """--no-one-token-layout is moe_triton's one_token_layout false (align sorts one token too): the
    group moe-one-token-ab runs both, one after another, into two result files."""
    from backplane.contracts.moe import MoeBackendContext
    from backplane.plugins.moe_triton.backend import TritonMoeBackend
    from backplane.plugins.moe_triton.options import TritonMoeOptions
    from bench import run

    sorted_ns = moe_decode.parse_args(["--no-one-token-layout", "--moe-configs", "t.json"])
    options = moe_decode.engine_settings(sorted_ns, tmp_path)["plugin_options"]["triton-moe"]
    assert options == {"configs": "t.json", "one_token_layout": False}
    ctx = MoeBackendContext(dtype=torch.float32, device=torch.device("cpu"), max_num_tokens=4,
                            options=TritonMoeOptions(one_token_layout=options["one_token_layout"]))
    assert TritonMoeBackend(ctx).one_token_layout is False
    assert TritonMoeBackend(MoeBackendContext(torch.float32, torch.device("cpu"), 4)).one_token_layout is True
    jobs = run.GROUPS["moe-one-token-ab"]
    assert not any(j.together for j in jobs)
    a, b = (moe_decode.parse_args(list(j.argv[2:])) for j in jobs)
    assert a.no_one_token_layout and not b.no_one_token_layout and a.batch_sizes == b.batch_sizes == [1]
    assert moe_decode.result_subject(a) == "qwen3-30b-a3b-sorted-one-token" != moe_decode.result_subject(b)
