"""Backend selection: explicit names are validated with every reason; `auto` picks and explains."""

from __future__ import annotations

import types

import pytest

from backplane.plugin.manager import load_plugins
from backplane import hookimpl
from backplane.plugin.registry import AttentionBackendSpec, LoraBackendSpec, ModelSpec, RegistrationError, Registry
from backplane.plugin.selection import (
    AttentionRequirements,
    LoraRequirements,
    SelectionError,
    select_attention_backend,
    select_lora_backend,
)

CPU_FP32 = AttentionRequirements(platform="cpu", dtype="float32", head_dim=64, modes=("extend", "decode"))


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.setenv("BACKPLANE_PLUGINS", "attention_triton,attention_flashinfer,lora_triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    registry = load_plugins().registry
    register = registry.callback("attention", "test_plugin", "test-dist")
    register(AttentionBackendSpec(
        name="needs_lib", factory=object, description="t", priority=500,
        available=lambda: "libfoo is not installed", install_hint="pip install libfoo"))
    register(AttentionBackendSpec(name="head128", factory=object, description="t", head_dims=(128,), priority=400))
    register(AttentionBackendSpec(name="no_window", factory=object, description="t", sliding_window=False))
    return registry


def test_unknown_name_lists_every_registered_backend_and_plugin(registry):
    with pytest.raises(SelectionError) as err:
        select_attention_backend(registry, "fastest", CPU_FP32)
    assert str(err.value) == (
        "--attention-backend: unknown backend 'fastest'; registered: "
        "flashinfer (plugin 'attention_flashinfer'), head128 (plugin 'test_plugin'), "
        "needs_lib (plugin 'test_plugin'), no_window (plugin 'test_plugin'), "
        "torch_native (plugin 'attention.builtin'), triton (plugin 'attention_triton'), or 'auto'. "
        "Not loaded, filtered out by BACKPLANE_PLUGINS=attention_triton,attention_flashinfer,lora_triton: "
        + ", ".join(_filtered_out())
    )


def _filtered_out() -> list[str]:
    """Every installed plugin entry point but the three the fixture keeps, as the message lists them."""
    from importlib.metadata import entry_points

    kept = {"attention_triton", "attention_flashinfer", "lora_triton"}
    names = sorted({ep.name for ep in entry_points(group="backplane.plugins")} - kept)
    assert {"ops_triton", "spec_eagle", "spec_ngram"} <= set(names)  # the bundled ones are always among them
    return names


def test_missing_dependency_names_reason_and_fix(registry):
    with pytest.raises(SelectionError) as err:
        select_attention_backend(registry, "needs_lib", CPU_FP32)
    assert str(err.value) == (
        "--attention-backend needs_lib (plugin 'test_plugin') cannot run here: libfoo is not installed."
        " To fix: pip install libfoo. Usable here: no_window, torch_native"
    )


def test_flashinfer_on_cpu_lists_every_reason(registry):
    with pytest.raises(SelectionError) as err:
        select_attention_backend(registry, "flashinfer", CPU_FP32)
    msg = str(err.value)
    assert msg.startswith("--attention-backend flashinfer (plugin 'attention_flashinfer') cannot run here: ")
    assert "platform 'cpu' not supported (supports: cuda)" in msg
    assert "dtype float32 not supported (supports: float16, bfloat16)" in msg
    assert msg.endswith("Usable here: no_window, torch_native")


def test_platform_and_head_dim_reasons(registry):
    with pytest.raises(SelectionError) as err:
        select_attention_backend(registry, "head128", CPU_FP32)
    assert str(err.value) == (
        "--attention-backend head128 (plugin 'test_plugin') cannot run here: "
        "head dim 64 not supported (supports: 128). Usable here: no_window, torch_native"
    )
    with pytest.raises(SelectionError, match=r"platform 'cpu' not supported \(supports: cuda\)"):
        select_attention_backend(registry, "triton", CPU_FP32)


def test_capability_needed_by_the_model(registry):
    req = AttentionRequirements(platform="cpu", dtype="float32", head_dim=64, modes=("extend",), sliding_window=True)
    with pytest.raises(SelectionError, match="sliding window not supported, and this model/configuration needs it"):
        select_attention_backend(registry, "no_window", req, flag="--decode-attention-backend")


def test_auto_on_cpu_picks_the_best_usable_and_says_why(registry):
    choice = select_attention_backend(registry, "auto", CPU_FP32)
    assert choice.spec.name == "no_window"  # priority 0, name order before torch_native
    assert "skipped needs_lib (plugin 'test_plugin'): libfoo is not installed" in choice.reason
    assert "head128 (plugin 'test_plugin'): head dim 64 not supported" in choice.reason
    assert "flashinfer (plugin 'attention_flashinfer'):" in choice.reason and "triton (plugin" in choice.reason
    assert [reg.item.name for reg in choice.alternatives][-1] == "torch_native"  # build_first's next candidates


def test_auto_with_nothing_usable(registry):
    req = AttentionRequirements(platform="cpu", dtype="float8", head_dim=64, modes=("decode",))
    with pytest.raises(SelectionError, match=r"--attention-backend auto: no registered backend can run on platform 'cpu' with dtype float8"):
        select_attention_backend(registry, "auto", req)


def test_explicit_choice_is_explained(registry):
    choice = select_attention_backend(registry, "torch_native", CPU_FP32, flag="--prefill-attention-backend")
    assert choice.plugin == "attention.builtin"
    assert choice.reason == "torch_native chosen explicitly by --prefill-attention-backend"


def test_lora_selection(registry):
    req = LoraRequirements(platform="cpu", dtype="float32", max_rank=16)
    assert select_lora_backend(registry, "auto", req).spec.name == "torch_native"
    with pytest.raises(SelectionError, match="--lora-backend triton .* cannot run here: .*platform 'cpu' not supported"):
        select_lora_backend(registry, "triton", req)


def test_register_rejects_wrong_types_and_values(registry):
    register = registry.callback("attention", "sloppy", None)
    with pytest.raises(RegistrationError, match="plugin 'sloppy' registered a LoraBackendSpec as attention backend; expected AttentionBackendSpec"):
        register(LoraBackendSpec(name="x", factory=object, description="t"))
    with pytest.raises(RegistrationError, match=r"plugin 'sloppy', attention backend 'x': field platforms = \('tpu',\) \(tuple\): expected a tuple"):
        register(AttentionBackendSpec(name="x", factory=object, description="t", platforms=("tpu",)))
    with pytest.raises(RegistrationError, match=r"attention backend 'x': field modes = \('prefill',\)"):
        register(AttentionBackendSpec(name="x", factory=object, description="t", modes=("prefill",)))
    register(AttentionBackendSpec(name="once", factory=object, description="t"))
    with pytest.raises(RegistrationError, match="attention backend 'once' registered twice: by plugin 'sloppy' and by plugin 'sloppy'"):
        register(AttentionBackendSpec(name="once", factory=object, description="t"))
    models = registry.callback("model", "sloppy", None)
    with pytest.raises(RegistrationError, match="model architecture 'LlamaForCausalLM' registered twice: by plugin 'models.builtin'"):
        models(ModelSpec(architecture="LlamaForCausalLM", factory=object))


def _twin_plugins(priority_a: int = 0, priority_b: int = 0):
    """Two throwaway plugins that both register an attention backend named "sdpa"."""
    specs = {}
    plugins = []
    for plugin_name, priority in (("sdpa_a", priority_a), ("sdpa_b", priority_b)):
        spec = AttentionBackendSpec(name="sdpa", factory=object, description=plugin_name, priority=priority)
        specs[plugin_name] = spec
        plugin = types.SimpleNamespace(__name__=plugin_name)
        plugin.backplane_register_attention_backends = hookimpl(lambda register, spec=spec: register(spec))
        plugins.append(plugin)
    return plugins, specs


def test_a_name_two_plugins_register_is_an_error_naming_both(monkeypatch):
    monkeypatch.setenv("BACKPLANE_PLUGINS", "")
    plugins, specs = _twin_plugins()
    plugin_set = load_plugins(extra=plugins)
    assert all(p.error is None for p in plugin_set.plugins)
    with pytest.raises(SelectionError) as err:
        select_attention_backend(plugin_set.registry, "sdpa", CPU_FP32)
    assert str(err.value) == (
        "--attention-backend: attention backend 'sdpa' is registered by 2 plugins: plugin 'sdpa_a' and "
        "plugin 'sdpa_b'; pin one with --attention-backend sdpa@sdpa_a or sdpa@sdpa_b")
    assert select_attention_backend(plugin_set.registry, "sdpa@sdpa_b", CPU_FP32).spec is specs["sdpa_b"]
    assert select_attention_backend(plugin_set.registry, "sdpa@sdpa_a", CPU_FP32).plugin == "sdpa_a"
    with pytest.raises(SelectionError, match="no plugin or distribution 'sdpa_c' registered attention backend 'sdpa'"):
        select_attention_backend(plugin_set.registry, "sdpa@sdpa_c", CPU_FP32)


def test_auto_refuses_a_shared_winner_but_not_a_shared_loser(monkeypatch):
    monkeypatch.setenv("BACKPLANE_PLUGINS", "")
    plugins, _ = _twin_plugins(priority_a=1000, priority_b=1000)
    with pytest.raises(SelectionError, match="auto: attention backend 'sdpa' is registered by 2 plugins.*sdpa@sdpa_a"):
        select_attention_backend(load_plugins(extra=plugins).registry, "auto", CPU_FP32)
    plugins, _ = _twin_plugins(priority_a=-5, priority_b=-5)
    assert select_attention_backend(load_plugins(extra=plugins).registry, "auto", CPU_FP32).spec.name == "torch_native"


def test_pin_by_distribution_and_a_failed_twin_unshares_the_name():
    registry = Registry()
    for plugin, dist in (("a", "backplane-sdpa"), ("b", "other-sdpa")):
        registry.callback("attention", plugin, dist)(AttentionBackendSpec(name="sdpa", factory=object, description=plugin))
    assert select_attention_backend(registry, "sdpa@other-sdpa", CPU_FP32).plugin == "b"
    with pytest.raises(SelectionError, match="plugin 'a' \\(distribution backplane-sdpa\\) and plugin 'b'"):
        select_attention_backend(registry, "sdpa", CPU_FP32)
    registry.remove_plugin("a")
    assert select_attention_backend(registry, "sdpa", CPU_FP32).plugin == "b"
    assert registry.registrations("attention", "sdpa") == [registry.provenance("attention", "sdpa")]


def test_auto_breaks_equal_priorities_by_name_then_plugin():
    registry = Registry()
    for plugin, name in (("p2", "beta"), ("p1", "alpha"), ("p0", "gamma")):
        registry.callback("attention", plugin, None)(AttentionBackendSpec(name=name, factory=object, description="t",
                                                                          priority=7))
    assert select_attention_backend(registry, "auto", CPU_FP32).spec.name == "alpha"

