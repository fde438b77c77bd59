"""Plugin discovery through real installed distributions: third-party, broken, filtered, strict."""

from __future__ import annotations

import json
import os
import types

import pytest

from backplane.cli import main
from backplane.plugin.manager import PluginLoadError, load_plugins
from backplane.plugin.selection import AttentionRequirements, SelectionError, select_attention_backend


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


def test_filter_typo_is_fatal_in_strict_mode(monkeypatch, capsys):
    monkeypatch.setenv("BACKPLANE_PLUGINS", "attention_triton,atention_flashinfer")
    with pytest.raises(PluginLoadError, match="no installed plugin is named 'atention_flashinfer'.*strict"):
        load_plugins(strict=True)
    assert main(["plugins", "--strict-plugins"]) == 2
    assert "atention_flashinfer" in capsys.readouterr().err


def test_empty_filter_warns(monkeypatch):
    monkeypatch.setenv("BACKPLANE_PLUGINS", "")
    assert any("BACKPLANE_PLUGINS is set but empty" in w for w in load_plugins().warnings)
    monkeypatch.setenv("BACKPLANE_PLUGINS", "attention_triton")
    assert not any("empty" in w for w in load_plugins().warnings)


def test_backend_of_a_filtered_plugin_says_it_was_filtered(example_plugin, monkeypatch):
    monkeypatch.setenv("BACKPLANE_PLUGINS", "attention_triton")
    registry = load_plugins().registry
    req = AttentionRequirements(platform="cpu", dtype="float32", head_dim=64, modes=("decode",))
    with pytest.raises(SelectionError) as err:
        select_attention_backend(registry, "example", req)
    message = str(err.value)
    assert "unknown backend 'example'" in message
    assert "Not loaded, filtered out by BACKPLANE_PLUGINS=attention_triton: " in message
    assert "example" in message.partition("Not loaded")[2]
    monkeypatch.delenv("BACKPLANE_PLUGINS")
    assert "filtered" not in str(pytest.raises(SelectionError, select_attention_backend,
                                               load_plugins().registry, "nope", req).value)


def test_backend_of_a_failed_plugin_says_it_failed(bad_plugins, monkeypatch):
    monkeypatch.setenv("BACKPLANE_PLUGINS", "bad_register")
    req = AttentionRequirements(platform="cpu", dtype="float32", head_dim=64, modes=("decode",))
    with pytest.raises(SelectionError, match="Not loaded, failed to load: RuntimeError: bad_register plugin.*: bad_register"):
        select_attention_backend(load_plugins().registry, "half_registered", req)


def test_bundled_plugins_register_through_entry_points(monkeypatch):
    monkeypatch.delenv("BACKPLANE_PLUGINS", raising=False)
    plugin_set = load_plugins()
    bundled = {p.name: p for p in plugin_set.plugins if p.distribution == "backplane-llm"}
    assert {"attention_triton", "attention_flashinfer", "lora_triton", "spec_eagle", "spec_ngram"} <= set(bundled)
    assert plugin_set.registry.provenance("attention", "triton").plugin == "attention_triton"


BROKEN = {
    # plugin: (what the error says, where it points: the plugin's own file and line)
    "bad_import": ("ImportError: bad_import plugin: simulated missing dependency", "bad_import.py:1"),
    "bad_register": ("RuntimeError: bad_register plugin: exploded while registering", "bad_register.py:7"),
    "duplicate": ("model architecture 'LlamaForCausalLM' registered twice: by plugin 'models.builtin' "
                  "and by plugin 'duplicate'", "duplicate.py:6"),
    "misspelt": ("implements unknown hook 'backplane_register_attention_backend'", "misspelt.py:4"),
    "bad_syntax": ("SyntaxError: ", "bad_syntax.py:4"),
    "bad_args": ("hook backplane_register_attention_backends takes unknown argument(s) device; "
                 "the spec's arguments: register", "bad_args.py:4"),
    "bad_spec": ("attention backend 'odd': field platforms = ('tpu',) (tuple): expected a tuple", "bad_spec.py:6"),
}


@pytest.mark.parametrize("plugin", sorted(BROKEN))
def test_broken_plugin_is_recorded_and_the_rest_load(bad_plugins, monkeypatch, plugin):
    monkeypatch.setenv("BACKPLANE_PLUGINS", f"{plugin},attention_triton")
    plugin_set = load_plugins()
    info = _plugin(plugin_set, plugin)
    expected, location = BROKEN[plugin]
    assert expected in info.error
    assert info.error.endswith(f"backplane_bad_plugins{os.sep}{location})"), info.error
    assert "{" not in info.error and "\n" not in info.error  # one line, no dict dump
    assert info.registered == []
    assert _plugin(plugin_set, "attention_triton").error is None
    assert "triton" in plugin_set.registry.specs("attention")
    assert plugin_set.registry.provenance("attention", "torch_native").plugin == "attention.builtin"
    assert "half_registered" not in plugin_set.registry.specs("attention")
    assert any(plugin in w for w in plugin_set.warnings)


def test_plugin_name_taken_twice_is_one_line_without_a_dict_dump(monkeypatch):
    monkeypatch.setenv("BACKPLANE_PLUGINS", "")
    twin = types.SimpleNamespace(__name__="attention.builtin")
    plugin_set = load_plugins(extra=[twin])
    info = plugin_set.plugins[-1]
    assert info.error == ("plugin name 'attention.builtin' is already taken (by "
                          "backplane.attention.builtin); give the entry point or plugin object another name")
    assert plugin_set.registry.provenance("attention", "torch_native").plugin == "attention.builtin"


@pytest.mark.parametrize("plugin", sorted(BROKEN))
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
