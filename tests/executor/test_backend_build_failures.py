"""A backend factory that fails inside a real engine start: `auto` builds the next candidate and logs
why; a named backend is one line naming the plugin, the kind and the plugin's file:line, and the
CLI exits with code 2 and no traceback. The model factory and the custom-op probe likewise."""

from __future__ import annotations

import importlib
import logging
import types

import pytest

from backplane import AttentionBackendSpec, Engine, hookimpl
from backplane.cli import main
from backplane.plugin.manager import load_plugins
from backplane.plugin.runtime import PluginRuntimeError

HERE = "test_backend_build_failures.py:"


def _broken_factory(ctx):
    import backplane_missing_kernels  # noqa: F401 - the plugin's heavy module fails to import

    raise AssertionError("unreachable")


def _plugin():
    def register(register):
        register(AttentionBackendSpec(name="shiny", factory=_broken_factory, description="broken on purpose",
                                      platforms=("cpu",), dtypes=("float32",), head_dims=(64,),
                                      modes=("extend", "decode"), priority=1000))

    register.__name__ = "backplane_register_attention_backends"
    return types.SimpleNamespace(__name__="shiny_plugin", backplane_register_attention_backends=hookimpl(register))


@pytest.fixture(autouse=True)
def _only_builtins(monkeypatch):
    monkeypatch.setenv("BACKPLANE_PLUGINS", "")


def test_auto_builds_the_next_candidate_and_logs_why(caplog):
    with caplog.at_level(logging.WARNING, logger="backplane.plugin.runtime"):
        engine = Engine("tiny-llama", device="cpu", dtype="float32", max_total_tokens=256, plugins=[_plugin()])
    chosen = engine.runner.attn_choices["decode"]
    assert chosen.spec.name == "torch_native" and "after shiny failed to build" in chosen.reason
    assert any("plugin 'shiny_plugin'" in r.message and "backplane_missing_kernels" in r.message for r in caplog.records)
    assert engine.generate(input_ids=[[1, 2, 3]])[0].error is None


def test_a_named_backend_that_fails_to_build_is_one_line():
    with pytest.raises(PluginRuntimeError) as info:
        Engine("tiny-llama", device="cpu", dtype="float32", max_total_tokens=256, plugins=[_plugin()],
               attention_backend="shiny")
    message = str(info.value)
    assert message.startswith("plugin 'shiny_plugin': attention backend 'shiny': factory raised ModuleNotFoundError")
    assert HERE in message and "\n" not in message


def test_the_cli_prints_one_line_and_exits_2(monkeypatch, capsys):
    cli_main = importlib.import_module("backplane.cli.main")
    monkeypatch.setattr(cli_main, "load_plugins", lambda strict=None: load_plugins(extra=[_plugin()]))
    code = main(["generate", "--model", "tiny-llama", "--device", "cpu", "--dtype", "float32",
                 "--attention-backend", "shiny", "--max-total-tokens", "256"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("backplane: error: plugin 'shiny_plugin': attention backend 'shiny': factory raised")
    assert err.count("\n") == 1 and "Traceback" not in err


def _lora_plugin():
    from backplane import LoraBackendSpec

    def register(register):
        register(LoraBackendSpec(name="shiny-lora", factory=_broken_factory, description="broken on purpose",
                                 platforms=("cpu",), dtypes=("float32",), priority=1000))

    register.__name__ = "backplane_register_lora_backends"
    return types.SimpleNamespace(__name__="shiny_lora_plugin", backplane_register_lora_backends=hookimpl(register))


def test_lora_auto_builds_the_next_candidate(tmp_path, caplog):
    from lora_helpers import make_lora_world

    world = make_lora_world(tmp_path)
    with caplog.at_level(logging.WARNING, logger="backplane.plugin.runtime"):
        engine = Engine(str(world.base_dir), device="cpu", dtype="float32", max_total_tokens=512,
                        lora_paths=world.lora_paths(), plugins=[_lora_plugin()])
    assert engine.lora_manager.selection.spec.name != "shiny-lora"
    assert "after shiny-lora failed to build" in engine.lora_manager.selection.reason
    assert any("plugin 'shiny_lora_plugin'" in r.message for r in caplog.records)
    out = engine.generate(input_ids=[[5, 6, 7]], lora=["all7_r4"])[0]
    assert out.error is None
