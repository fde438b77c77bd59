"""Plugin discovery through real installed distributions: third-party, broken, filtered, strict."""

from __future__ import annotations

import json

import pytest

from backplane.cli import main
from backplane.plugin.manager import PluginLoadError, load_plugins


def _plugin(plugin_set, name):
    return next(p for p in plugin_set.plugins if p.name == name)


def test_third_party_plugin_is_discovered_and_listed(example_plugin, monkeypatch, capsys):
    monkeypatch.delenv("BACKPLANE_PLUGINS", raising=False)
    plugin_set = load_plugins()
    info = _plugin(plugin_set, "example")
    assert info.error is None
    assert info.distribution == "backplane-example-plugin" and info.version == "0.3.1"
    assert "attention:example" in info.registered and "settings:example" in info.registered
    assert plugin_set.registry.provenance("attention", "example").plugin == "example"
    assert main(["plugins", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    listed = {b["name"]: b for b in report["attention_backends"]}
    assert listed["example"]["plugin"] == "example" and listed["example"]["usable"] is True


def test_backplane_plugins_filter_hides_the_third_party_plugin(example_plugin, monkeypatch):
    monkeypatch.setenv("BACKPLANE_PLUGINS", "attention_triton")
    plugin_set = load_plugins()
    names = [p.name for p in plugin_set.plugins if not p.builtin]
    assert names == ["attention_triton"]
    assert "example" not in plugin_set.registry.specs("attention")


def test_empty_filter_loads_only_builtins(monkeypatch):
    monkeypatch.setenv("BACKPLANE_PLUGINS", "")
    plugin_set = load_plugins()
    assert all(p.builtin for p in plugin_set.plugins)
    assert "torch_native" in plugin_set.registry.specs("attention")


def test_filter_naming_nothing_warns(monkeypatch):
    monkeypatch.setenv("BACKPLANE_PLUGINS", "attention_triton,no_such_plugin")
    plugin_set = load_plugins()
    assert any("'no_such_plugin'" in w and "BACKPLANE_PLUGINS" in w for w in plugin_set.warnings)


def test_bundled_plugins_register_through_entry_points(monkeypatch):
    monkeypatch.delenv("BACKPLANE_PLUGINS", raising=False)
    plugin_set = load_plugins()
    bundled = {p.name: p for p in plugin_set.plugins if p.distribution == "backplane-llm"}
    assert {"attention_triton", "attention_flashinfer", "lora_triton", "spec_eagle", "spec_ngram"} <= set(bundled)
    assert plugin_set.registry.provenance("attention", "triton").plugin == "attention_triton"


@pytest.mark.parametrize(
    "plugin, expected",
    [
        ("bad_import", "ImportError: bad_import plugin: simulated missing dependency"),
        ("bad_register", "RuntimeError: bad_register plugin: exploded while registering"),
        ("duplicate", "attention backend 'torch_native' registered twice: by plugin "
                      "'attention.builtin' and by plugin 'duplicate'"),
        ("misspelt", "implements unknown hook 'backplane_register_attention_backend'"),
    ],
)
def test_broken_plugin_is_recorded_and_the_rest_load(bad_plugins, monkeypatch, plugin, expected):
    monkeypatch.setenv("BACKPLANE_PLUGINS", f"{plugin},attention_triton")
    plugin_set = load_plugins()
    info = _plugin(plugin_set, plugin)
    assert expected in info.error
    assert info.registered == []
    assert _plugin(plugin_set, "attention_triton").error is None
    assert "triton" in plugin_set.registry.specs("attention")
    assert plugin_set.registry.provenance("attention", "torch_native").plugin == "attention.builtin"
    assert "half_registered" not in plugin_set.registry.specs("attention")
    assert any(plugin in w for w in plugin_set.warnings)


@pytest.mark.parametrize("plugin", ["bad_import", "bad_register", "duplicate", "misspelt"])
def test_broken_plugin_is_fatal_in_strict_mode(bad_plugins, monkeypatch, plugin):
    monkeypatch.setenv("BACKPLANE_PLUGINS", plugin)
    with pytest.raises(PluginLoadError, match=f"plugin '{plugin}'.*strict mode"):
        load_plugins(strict=True)
    monkeypatch.setenv("BACKPLANE_STRICT_PLUGINS", "1")
    with pytest.raises(PluginLoadError):
        load_plugins()


def test_strict_flag_on_the_cli_exits_2(bad_plugins, monkeypatch, capsys):
    monkeypatch.setenv("BACKPLANE_PLUGINS", "bad_import")
    assert main(["plugins", "--strict-plugins"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bad_import" in err and "strict" in err
    assert main(["plugins"]) == 0  # not strict: listed with its error


def test_plugins_listing_shows_load_errors(bad_plugins, monkeypatch, capsys):
    monkeypatch.setenv("BACKPLANE_PLUGINS", "bad_register")
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "bad_register" in out and "FAILED: RuntimeError: bad_register plugin" in out
