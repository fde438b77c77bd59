"""Plugin failures after discovery: factories, configure, available() and custom ops, each one line
naming the plugin, what failed and the plugin's file:line; `auto` moves on with the reason logged."""

from __future__ import annotations


import pytest
from helpers_plugins import make_plugin as _plugin
import torch

from backplane import AttentionBackendSpec, CustomOpImpl, LoraBackendSpec, ModelSpec, SpecAlgorithmSpec
from backplane.cli import main
from backplane.ops.dispatch import resolve_custom_ops
from backplane.plugin.manager import load_plugins
from backplane.plugin.registry import Registered
from backplane.plugin.runtime import PluginRuntimeError, build, build_first
from backplane.plugin.selection import AttentionRequirements, select_attention_backend

HERE = "test_plugin_runtime.py:"
REQ = AttentionRequirements(platform="cpu", dtype="float32", head_dim=64, modes=("decode",))


@pytest.fixture(autouse=True)
def _only_builtins(monkeypatch):
    monkeypatch.setenv("BACKPLANE_PLUGINS", "")


def _broken_import(ctx=None, *more):
    import backplane_no_such_kernels  # noqa: F401 - the plugin's heavy module is missing

    return None


def _returns_a_dict(*args):
    return {"not": "a backend"}


SPECS = {
    "attention": AttentionBackendSpec(name="broken", factory=_broken_import, description="t"),
    "lora": LoraBackendSpec(name="broken", factory=_broken_import, description="t"),
    "spec": SpecAlgorithmSpec(name="broken", factory=_broken_import, description="t"),
    "model": ModelSpec(architecture="broken", factory=_broken_import),
}
LABELS = {"attention": "attention backend", "lora": "LoRA backend", "spec": "speculative algorithm",
          "model": "model architecture"}


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_a_factory_that_raises_is_one_line_with_plugin_kind_name_and_location(kind):
    with pytest.raises(PluginRuntimeError) as err:
        build(Registered(SPECS[kind], "thirdparty"), None, kind=kind)
    message = str(err.value)
    assert message.startswith(f"plugin 'thirdparty': {LABELS[kind]} 'broken': factory raised ModuleNotFoundError: "
                              "No module named 'backplane_no_such_kernels' (at ")
    assert HERE in message and "\n" not in message


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_a_factory_that_returns_the_wrong_type_is_one_line(kind):
    from dataclasses import replace

    spec = replace(SPECS[kind], factory=_returns_a_dict)
    with pytest.raises(PluginRuntimeError) as err:
        build(Registered(spec, "thirdparty"), None, kind=kind)
    expected = {"attention": "AttentionBackend", "lora": "LoraBackend", "spec": "SpecWorker", "model": "Module"}[kind]
    assert str(err.value).startswith(f"plugin 'thirdparty': {LABELS[kind]} 'broken': factory returned dict, "
                                     f"expected a {expected} (at ")


def test_auto_falls_back_to_the_next_candidate_and_logs_why(caplog):
    broken = AttentionBackendSpec(name="shiny", factory=_broken_import, description="t", priority=100)
    plugin = _plugin("shiny_plugin", backplane_register_attention_backends=lambda register: register(broken))
    registry = load_plugins(extra=[plugin]).registry
    choice = select_attention_backend(registry, "auto", REQ)
    assert choice.spec.name == "shiny" and [r.item.name for r in choice.alternatives] == ["torch_native"]
    with caplog.at_level("WARNING", logger="backplane.plugin.runtime"):
        backend, used = build_first(choice, lambda c: _context(), kind="attention")
    assert used.spec.name == "torch_native" and type(backend).__name__ == "TorchNativeAttnBackend"
    assert used.reason.startswith("torch_native chosen by auto after shiny failed to build: plugin 'shiny_plugin'")
    logged = [r.message for r in caplog.records if r.name == "backplane.plugin.runtime"]
    assert len(logged) == 1 and logged[0].endswith("auto takes torch_native (plugin 'attention.builtin') instead")
    explicit = select_attention_backend(registry, "shiny", REQ)
    with pytest.raises(PluginRuntimeError, match="^plugin 'shiny_plugin': attention backend 'shiny': factory raised"):
        build_first(explicit, lambda c: _context(), kind="attention")


def _context():
    from backplane.contracts.attention import AttentionBackendContext

    return AttentionBackendContext(num_heads=2, num_kv_heads=1, head_dim=64, num_layers=1, dtype=torch.float32,
                                   device=torch.device("cpu"), req_to_token_pool=None, token_to_kv_pool=None,
                                   max_context_len=16)


@pytest.mark.parametrize("answer", [False, 0, True, "", ["cuda missing"]])
def test_available_returning_anything_but_none_or_a_reason_is_unusable(answer):
    spec = AttentionBackendSpec(name="odd", factory=object, description="t", priority=100, available=lambda: answer)
    plugin = _plugin("odd_plugin", backplane_register_attention_backends=lambda register: register(spec))
    registry = load_plugins(extra=[plugin]).registry
    choice = select_attention_backend(registry, "auto", REQ)
    assert choice.spec.name == "torch_native"
    assert f"skipped odd (plugin 'odd_plugin'): available() returned {answer!r}; expected None (usable) or a reason " \
           f"string (at " in choice.reason and HERE in choice.reason
    with pytest.raises(Exception, match=r"--attention-backend odd \(plugin 'odd_plugin'\) cannot run here: available\(\)"):
        select_attention_backend(registry, "odd", REQ)


def test_a_configure_hook_that_raises_is_one_line_and_exit_2(monkeypatch, capsys):
    def configure(settings):
        raise KeyError("num_kv_splits")

    import importlib

    cli_main = importlib.import_module("backplane.cli.main")  # the module: backplane.cli.main is also the function
    monkeypatch.setattr(cli_main, "load_plugins", lambda strict=None: load_plugins(
        extra=[_plugin("grumpy", backplane_configure=configure)]))
    assert main(["generate", "--model", "tiny-llama", "--load-format", "dummy"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("backplane: error: plugin 'grumpy': hook backplane_configure raised KeyError: "
                          "'num_kv_splits' (at ")
    assert HERE in err and err.count("\n") == 1


def _wrong_shape_rms_norm(x, weight, eps):
    return x[..., :-1]


def _raising_silu(x):
    raise RuntimeError("kernel launch failed")


def _ops_registry():
    impls = [CustomOpImpl("rms_norm", "cpu", _wrong_shape_rms_norm, "bad_shape", priority=50),
             CustomOpImpl("silu_and_mul", "cpu", _raising_silu, "bad_raise", priority=50)]
    plugin = _plugin("bad_ops", backplane_register_custom_ops=lambda register: [register(i) for i in impls])
    return load_plugins(extra=[plugin]).registry


def test_auto_skips_a_custom_op_that_fails_its_probe_with_the_reason(caplog):
    registry = _ops_registry()
    with caplog.at_level("WARNING", logger="backplane.ops.dispatch"):
        ops = resolve_custom_ops(list(registry.specs("custom_op").values()), "cpu", {}, registry=registry, probe=True)
    assert ops.chosen["rms_norm"] == "native" and ops.chosen["silu_and_mul"] == "native"
    rms = next(m for m in caplog.messages if m.startswith("custom op rms_norm"))
    assert ("bad_shape (priority 50) cannot run: implementation 'bad_shape' of custom op 'rms_norm' returned [3, 63] "
            "float32, expected [3, 64] float32 like the native op on a probe input (at ") in rms
    assert "(plugin 'bad_ops')" in rms and HERE in rms
    silu = next(m for m in caplog.messages if m.startswith("custom op silu_and_mul"))
    assert "raised RuntimeError: kernel launch failed on a probe input" in silu and HERE in silu


def test_a_custom_op_named_explicitly_that_fails_its_probe_is_one_line():
    registry = _ops_registry()
    with pytest.raises(ValueError) as err:
        resolve_custom_ops(list(registry.specs("custom_op").values()), "cpu", {"rms_norm": "bad_shape"},
                           registry=registry, probe=True)
    assert str(err.value).startswith("custom op override 'rms_norm=bad_shape': implementation 'bad_shape' "
                                     "(plugin 'bad_ops') cannot run here: implementation 'bad_shape' of custom op "
                                     "'rms_norm' returned [3, 63] float32")


def test_plugins_listing_gives_the_real_reason_on_cpu(monkeypatch, capsys):
    monkeypatch.delenv("BACKPLANE_PLUGINS")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the CPU tests' interpreter mode makes triton usable
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    triton = next(line for line in out.splitlines() if line.strip().startswith("triton "))
    assert "no CUDA device" in triton
    assert "pip install triton" not in out  # triton is installed: the device is missing, not the package
