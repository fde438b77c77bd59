"""Loading, round three: the plugin API version, SystemExit/KeyboardInterrupt at import, bundled names
taken by a third party, two distributions with one entry-point name, slow imports, filtering."""

from __future__ import annotations

import os
import signal
import types

import pytest
from helpers_plugins import make_plugin as _plugin

from backplane import PLUGIN_API_VERSION, SpecAlgorithmSpec
from backplane.plugin import discovery, manager
from backplane.plugin.manager import PluginLoadError, load_plugins
from backplane.plugin.selection import SelectionError, resolve
from backplane.plugin.version import check_api_version


@pytest.fixture(autouse=True)
def _only_builtins(monkeypatch):
    monkeypatch.setenv("BACKPLANE_PLUGINS", "")


def test_plugin_api_version_is_major_minor_and_newer_than_the_first_release():
    major, minor = map(int, PLUGIN_API_VERSION.split("."))
    assert (major, minor) >= (1, 1)


@pytest.mark.parametrize(("needed", "error"), [
    ("1.0", None),
    (PLUGIN_API_VERSION, None),
    ("1.9", "plugin 'p' needs backplane plugin API 1.9, this backplane has 1.1 (it runs plugins written for 1.0 "
            "to 1.1); upgrade backplane"),
    ("2.0", "plugin 'p' needs backplane plugin API 2.0, this backplane has 1.1 (it runs plugins written for 1.0 "
            "to 1.1); upgrade backplane"),
    ("0.9", "plugin 'p' needs backplane plugin API 0.9, this backplane has 1.1 (it runs plugins written for 1.0 "
            "to 1.1); install a release of the plugin written for API 1.x"),
    (1.0, "plugin 'p': BACKPLANE_PLUGIN_API = 1.0; expected a string 'MAJOR.MINOR' such as '1.1'"),
])
def test_api_version_check(needed, error):
    if error is None:
        check_api_version("p", needed, core="1.1")
    else:
        with pytest.raises(Exception) as err:
            check_api_version("p", needed, core="1.1")
        assert str(err.value) == error


def test_incompatible_plugin_is_recorded_and_the_others_load():
    spec = SpecAlgorithmSpec(name="future", factory=object, description="t")
    future = _plugin("from_the_future", api="2.0", backplane_register_spec_algorithms=lambda register: register(spec))
    fine = _plugin("fine", api="1.0", backplane_register_spec_algorithms=lambda register: register(
        SpecAlgorithmSpec(name="fine", factory=object, description="t")))
    plugin_set = load_plugins(extra=[future, fine])
    info = {p.name: p for p in plugin_set.plugins}
    assert info["from_the_future"].error.startswith("plugin 'from_the_future' needs backplane plugin API 2.0, "
                                                    f"this backplane has {PLUGIN_API_VERSION}")
    assert "future" not in plugin_set.registry.specs("spec") and "fine" in plugin_set.registry.specs("spec")
    assert info["fine"].api == "1.0" and info["fine"].error is None
    with pytest.raises(PluginLoadError, match="'from_the_future' needs backplane plugin API 2.0.*strict mode"):
        load_plugins(strict=True, extra=[future])


def _raise(exc):
    def hook(register):
        raise exc

    return hook


@pytest.mark.parametrize(("exc", "says"), [
    (SystemExit(3), "SystemExit(3): it called sys.exit()"),
    (KeyboardInterrupt(), "KeyboardInterrupt"),
    (GeneratorExit(), "GeneratorExit"),
])
def test_base_exceptions_of_a_plugin_do_not_end_the_program(exc, says):
    plugin_set = load_plugins(extra=[_plugin("quitter", backplane_register_models=_raise(exc))])
    error = plugin_set.plugins[-1].error
    assert error.startswith(says) and f"{os.sep}test_plugin_loading.py:" in error
    assert "LlamaForCausalLM" in plugin_set.registry.specs("model")  # the builtins loaded


def test_a_real_ctrl_c_while_loading_is_passed_on():
    def interrupted(register):
        os.kill(os.getpid(), signal.SIGINT)  # the user's Ctrl-C arrives while this plugin loads
        signal.sigtimedwait([], 0.1) if hasattr(signal, "sigtimedwait") else None

    # NOTE: a shell's background job (`nohup pytest ... &`) starts with SIGINT ignored, and Python then
    # installs no handler: this test takes Python's own, as an interactive run has, and restores the
    # inherited one after
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            load_plugins(extra=[_plugin("slowpoke", backplane_register_models=interrupted)])
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is put back
    finally:
        signal.signal(signal.SIGINT, inherited)


class _Dist:
    def __init__(self, name, version="1.0"):
        self.name, self.version = name, version


def _entry_point(name, dist, plugin):
    return types.SimpleNamespace(name=name, value=f"{dist}_module", dist=_Dist(dist), load=lambda: plugin)


def _installed(monkeypatch, *eps):
    monkeypatch.setattr(discovery, "entry_points", lambda group: list(eps))
    monkeypatch.delenv("BACKPLANE_PLUGINS")


def test_third_party_plugin_taking_a_bundled_name_is_the_one_refused(monkeypatch):
    def register(name):
        return lambda register: register(SpecAlgorithmSpec(name="ngram", factory=object, description=name))

    bundled = _plugin("spec_ngram", backplane_register_spec_algorithms=register("bundled"))
    intruder = _plugin("aaa_ngram", backplane_register_spec_algorithms=register("intruder"))
    _installed(monkeypatch, _entry_point("aaa_ngram", "aaa-ngram", intruder),
               _entry_point("spec_ngram", "backplane-llm", bundled))
    plugin_set = load_plugins()
    assert [p.name for p in plugin_set.plugins if not p.builtin] == ["spec_ngram", "aaa_ngram"]
    assert plugin_set.registry.provenance("spec", "ngram").plugin == "spec_ngram"
    failed = {p.name: p.error for p in plugin_set.plugins if p.error}
    assert list(failed) == ["aaa_ngram"]
    assert failed["aaa_ngram"].startswith("speculative algorithm 'ngram' registered twice: by plugin 'spec_ngram' "
                                          "and by plugin 'aaa_ngram'")


def test_two_distributions_with_one_entry_point_name_are_both_reported(monkeypatch):
    first = _plugin("first", backplane_register_models=lambda register: None)
    second = _plugin("second", backplane_register_models=lambda register: None)
    _installed(monkeypatch, _entry_point("fast_attn", "zeta-attn", second), _entry_point("fast_attn", "alpha-attn", first))
    plugin_set = load_plugins()
    rows = [p for p in plugin_set.plugins if p.name == "fast_attn"]
    assert [(p.distribution, p.error is None) for p in rows] == [("alpha-attn", True), ("zeta-attn", False)]
    assert rows[1].error == ("entry point 'fast_attn' of distribution 'zeta-attn' (zeta-attn_module) has the name of "
                             "entry point 'fast_attn' of distribution 'alpha-attn' (alpha-attn_module), which loads "
                             "instead; uninstall one of the two or rename its entry point")
    assert any("'fast_attn' not loaded" in w and "alpha-attn" in w and "zeta-attn" in w for w in plugin_set.warnings)
    with pytest.raises(PluginLoadError, match="zeta-attn.*alpha-attn.*strict mode"):
        load_plugins(strict=True)


def test_a_slow_plugin_is_named_with_its_time(monkeypatch, caplog):
    monkeypatch.setattr(manager, "SLOW_IMPORT_S", 0.0)
    with caplog.at_level("DEBUG", logger="backplane.plugin.manager"):
        plugin_set = load_plugins(extra=[_plugin("sluggish", backplane_register_models=lambda register: None)])
    info = plugin_set.plugins[-1]
    assert info.load_seconds > 0
    assert any(w.startswith(f"plugin 'sluggish' (sluggish) took {info.load_seconds:.1f} s to load") for w in plugin_set.warnings)
    assert not any("'attention.builtin'" in w for w in plugin_set.warnings)  # builtins are not blamed for torch
    assert any("plugin 'sluggish' (sluggish) loaded in" in m for m in caplog.messages)


def test_a_filtered_plugins_algorithm_says_it_was_filtered(monkeypatch):
    monkeypatch.setenv("BACKPLANE_PLUGINS", "attention_triton")
    with pytest.raises(SelectionError) as err:
        resolve(load_plugins().registry, "spec", "ngram", "--speculative-algorithm")
    message = str(err.value)
    assert message.startswith("--speculative-algorithm: unknown speculative algorithm 'ngram'; registered: none. "
                              "Not loaded, filtered out by BACKPLANE_PLUGINS=attention_triton: ")
    assert "spec_ngram" in message and "install" not in message
