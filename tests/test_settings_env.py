"""Settings from the environment and combinations of flags (issue 42): JSON lists are parsed as JSON
(commas stay the fallback), an empty variable is unset, an empty model name is refused, speculative
flags without --speculative-algorithm are refused in one line, and the CPU thread count is chosen
from --cpu-threads, OMP_NUM_THREADS or the cores this process may use."""

from __future__ import annotations

import os

import pytest

from backplane.cli import main
from backplane.settings import (MAX_DEFAULT_CPU_THREADS, EngineArgs, SettingsError, build_server_args,
                                resolve_cpu_threads)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("BACKPLANE_") and name not in ("BACKPLANE_PLUGINS", "BACKPLANE_STRICT_PLUGINS"):
            monkeypatch.delenv(name)


@pytest.mark.parametrize("raw, expected", [
    ('["a=dir,with,commas", "b=x"]', ["a=dir,with,commas", "b=x"]),
    ("a=x,b=y", ["a=x", "b=y"]),
    ("a=x b=y", ["a=x", "b=y"]),
])
def test_list_env_is_json_or_comma_separated(monkeypatch, raw, expected):
    monkeypatch.setenv("BACKPLANE_LORA_PATHS", raw)
    assert EngineArgs().lora_paths == expected


def test_int_list_env_as_json(monkeypatch):
    monkeypatch.setenv("BACKPLANE_CUDA_GRAPH_BS", "[8, 1, 4]")
    assert EngineArgs().cuda_graph_bs == [1, 4, 8]


def test_bad_json_list_env_is_one_line(monkeypatch):
    monkeypatch.setenv("BACKPLANE_CUSTOM_OPS", '["rms_norm=native"')
    with pytest.raises(SettingsError) as err:
        build_server_args({})
    assert str(err.value).startswith("--custom-ops (env BACKPLANE_CUSTOM_OPS): invalid value")
    assert "expected a JSON list or comma-separated values" in str(err.value)


@pytest.mark.parametrize("name, field, default", [
    ("BACKPLANE_CUDA_GRAPH_BS", "cuda_graph_bs", None),
    ("BACKPLANE_LORA_PATHS", "lora_paths", []),
    ("BACKPLANE_MODEL", "model", "tiny-llama"),
    ("BACKPLANE_SEED", "seed", 0),
])
def test_empty_env_var_is_unset(monkeypatch, name, field, default):
    monkeypatch.setenv(name, "")
    assert getattr(EngineArgs(), field) == default


def test_empty_model_name_is_refused_in_one_line():
    with pytest.raises(SettingsError) as err:
        build_server_args({"model": " "})
    assert str(err.value) == ("--model (env BACKPLANE_MODEL): invalid value ' ': expected a preset name or a "
                              "local model directory, got an empty string")


@pytest.mark.parametrize("argv, named", [
    (["--speculative-num-draft-tokens", "8"], "--speculative-num-draft-tokens 8"),
    (["--speculative-token-map", "map.pt", "--speculative-num-steps", "5"], "--speculative-num-steps 5, "
     "--speculative-token-map 'map.pt'"),
])
def test_speculative_flags_without_an_algorithm_are_refused(capsys, argv, named):
    assert main(["generate", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err
    assert "take effect only with --speculative-algorithm" in err


def test_speculative_defaults_pass_without_an_algorithm():
    assert EngineArgs(speculative_num_steps=3).speculative_algorithm is None


def test_cpu_threads_by_flag_then_omp_then_cores(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert resolve_cpu_threads(EngineArgs(cpu_threads=5)) == (5, "--cpu-threads")
    assert resolve_cpu_threads(EngineArgs()) == (3, "OMP_NUM_THREADS")
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    threads, source = resolve_cpu_threads(EngineArgs())
    assert threads == MAX_DEFAULT_CPU_THREADS and source == "64 cores available to this process"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert resolve_cpu_threads(EngineArgs())[0] == 2
