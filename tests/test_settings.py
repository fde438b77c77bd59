"""EngineArgs: every flag by CLI and by env var, plugin option groups, one-line errors with exit 2."""

from __future__ import annotations

import pytest

from backplane.cli import main, parse_server_args
from backplane.plugin.manager import load_plugins
from backplane.settings import SPECULATIVE_OPTIONS, EngineArgs, SettingsError, env_name, flag_name

# One valid non-default value per field: (CLI words, env string, expected parsed value).
SAMPLES = {
    "model": (["llama-3.2-1b"], "llama-3.2-1b", "llama-3.2-1b"),
    "load_format": (["dummy"], "dummy", "dummy"),
    "tokenizer_path": (["tok"], "tok", "tok"),
    "dtype": (["float16"], "float16", "float16"),
    "device": (["cpu"], "cpu", "cpu"),
    "seed": (["7"], "7", 7),
    "context_length": (["512"], "512", 512),
    "tp_size": (["2"], "2", 2),
    "cpu_threads": (["3"], "3", 3),
    "attention_backend": (["triton"], "triton", "triton"),
    "prefill_attention_backend": (["torch_native"], "torch_native", "torch_native"),
    "decode_attention_backend": (["triton"], "triton", "triton"),
    "moe_backend": (["torch_native"], "torch_native", "torch_native"),
    "custom_ops": (["rms_norm=native", "silu_and_mul=native"], "rms_norm=native,silu_and_mul=native",
                   ["rms_norm=native", "silu_and_mul=native"]),
    "strict_plugins": ([], "1", True),
    "lora_paths": (["a=dir_a", "b=dir_b"], "a=dir_a b=dir_b", ["a=dir_a", "b=dir_b"]),
    "lora_backend": (["triton"], "triton", "triton"),
    "max_loras_per_batch": (["3"], "3", 3),
    "max_lora_rank": (["32"], "32", 32),
    "speculative_algorithm": (["ngram"], "ngram", "ngram"),
    "speculative_draft_model": (["draft"], "draft", "draft"),
    "speculative_num_steps": (["5"], "5", 5),
    "speculative_eagle_topk": (["4"], "4", 4),
    "speculative_num_draft_tokens": (["8"], "8", 8),
    "speculative_token_map": (["map.pt"], "map.pt", "map.pt"),
    "cuda_graph_bs": (["8", "1", "4"], "8,1,4", [1, 4, 8]),
    "cuda_graph_max_bs": (["64"], "64", 64),
    "disable_extend_graph": ([], "true", True),
    "quantization": (["fp8"], "fp8", "fp8"),
    "kv_cache_dtype": (["fp8"], "fp8", "fp8_e4m3"),  # vLLM's alias, stored as the one dtype it names
    "cuda_graph_max_tokens": (["256"], "256", 256),
    "cuda_graph_max_extend_bs": (["4"], "4", 4),
    "disable_cuda_graph": ([], "true", True),
    "disable_cuda_graph_padding": ([], "1", True),
    "disable_overlap_schedule": ([], "true", True),
    "enable_torch_compile": ([], "1", True),
    "torch_compile_max_bs": (["16"], "16", 16),
    "mem_fraction_static": (["0.5"], "0.5", 0.5),
    "max_total_tokens": (["4096"], "4096", 4096),
    "max_running_requests": (["12"], "12", 12),
    "chunked_prefill_size": (["256"], "256", 256),
    "disable_radix_cache": ([], "1", True),
    "gc_freeze": ([], "1", True),
    "log_level": (["info"], "info", "info"),
}


@pytest.fixture(scope="module")
def plugin_set():
    return load_plugins()


def test_every_field_has_a_sample():
    assert set(SAMPLES) == set(EngineArgs.model_fields) - {"plugin_options"}


@pytest.mark.parametrize("field", sorted(SAMPLES))
def test_flag_by_cli(field, plugin_set, monkeypatch):
    for name in EngineArgs.model_fields:
        monkeypatch.delenv(env_name(name), raising=False)
    words, _, expected = SAMPLES[field]
    needs = ["--speculative-algorithm", "eagle"] if field in SPECULATIVE_OPTIONS else []
    args = parse_server_args([flag_name(field), *words, *needs], plugin_set)
    assert getattr(args, field) == expected


@pytest.mark.parametrize("field", sorted(SAMPLES))
def test_flag_by_env(field, plugin_set, monkeypatch):
    _, raw, expected = SAMPLES[field]
    monkeypatch.setenv(env_name(field), raw)
    if field in SPECULATIVE_OPTIONS:
        monkeypatch.setenv("BACKPLANE_SPECULATIVE_ALGORITHM", "eagle")
    assert getattr(parse_server_args([], plugin_set), field) == expected


def test_cli_wins_over_env(plugin_set, monkeypatch):
    monkeypatch.setenv("BACKPLANE_SEED", "5")
    assert parse_server_args(["--seed", "9"], plugin_set).seed == 9


def test_boolean_flag_can_be_negated(plugin_set, monkeypatch):
    monkeypatch.setenv("BACKPLANE_DISABLE_CUDA_GRAPH", "1")
    assert parse_server_args(["--no-disable-cuda-graph"], plugin_set).disable_cuda_graph is False


def test_plugin_option_group_by_cli_and_env(example_plugin, monkeypatch):
    monkeypatch.delenv("BACKPLANE_PLUGINS", raising=False)
    plugin_set = load_plugins()
    args = parse_server_args(["--example.greeting", "hi", "--example.repeat", "3"], plugin_set)
    assert args.options_for("example").greeting == "hi" and args.options_for("example").repeat == 3
    monkeypatch.setenv("BACKPLANE_EXAMPLE__REPEAT", "4")
    assert parse_server_args([], plugin_set).options_for("example").repeat == 4


def test_bundled_plugin_option_groups_exist(plugin_set):
    args = parse_server_args(["--triton-attention.num-kv-splits", "4"], plugin_set)
    assert args.options_for("triton-attention").num_kv_splits == 4


def test_bad_plugin_option_is_one_line(example_plugin, monkeypatch, capsys):
    monkeypatch.delenv("BACKPLANE_PLUGINS", raising=False)
    assert main(["generate", "--example.repeat", "many"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--example.repeat (env BACKPLANE_EXAMPLE__REPEAT): invalid value 'many'" in err


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--seed", "-3"], "--seed (env BACKPLANE_SEED): invalid value '-3': Input should be greater than or equal to 0"),
        (["--max-running-requests", "0"], "--max-running-requests (env BACKPLANE_MAX_RUNNING_REQUESTS): invalid value '0'"),
        (["--dtype", "fp8"], "--dtype (env BACKPLANE_DTYPE): invalid value 'fp8': Input should be 'auto', 'float32', 'float16' or 'bfloat16'"),
        (["--device", "tpu"], "--device (env BACKPLANE_DEVICE): invalid value 'tpu'"),
        (["--lora-paths", "noequals"], "--lora-paths (env BACKPLANE_LORA_PATHS): invalid value ['noequals']: expected name=path, got 'noequals'"),
        (["--lora-paths", "a=x", "a=y"], "expected distinct adapter names"),
        (["--cuda-graph-bs", "0", "4"], "--cuda-graph-bs (env BACKPLANE_CUDA_GRAPH_BS): invalid value ['0', '4']: expected positive batch sizes"),
        (["--cuda-graph-bs", "4", "4"], "expected distinct batch sizes, got duplicates"),
        (["--mem-fraction-static", "1.5"], "--mem-fraction-static (env BACKPLANE_MEM_FRACTION_STATIC): invalid value '1.5': Input should be less than 1"),
        (["--custom-ops", "rms_norm"], "--custom-ops (env BACKPLANE_CUSTOM_OPS): invalid value ['rms_norm']: expected op=implementation"),
    ],
)
def test_bad_values_are_one_line_exit_2(argv, fragment, capsys):
    assert main(["generate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert fragment in err


def test_bad_env_value_is_one_line(monkeypatch, capsys):
    monkeypatch.setenv("BACKPLANE_CUDA_GRAPH_MAX_BS", "-8")
    assert main(["generate"]) == 2
    err = capsys.readouterr().err
    assert "--cuda-graph-max-bs (env BACKPLANE_CUDA_GRAPH_MAX_BS): invalid value '-8'" in err


def test_settings_error_type():
    from backplane.settings import build_server_args

    with pytest.raises(SettingsError):
        build_server_args({"seed": "x"})


def test_engine_arguments_group_and_the_deprecated_alias(capsys):
    import backplane

    assert backplane.ServerArgs is backplane.EngineArgs
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    assert "engine arguments:" in out and "server arguments" not in out


def test_kv_cache_dtype_fp8_is_the_e4m3_cache_and_e5m2_is_refused(plugin_set):
    assert EngineArgs(kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"
    assert EngineArgs(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(Exception, match="fp8_e5m2") as err:
        EngineArgs(kv_cache_dtype="fp8_e5m2")
    assert "fp8_e4m3" in str(err.value)
