"""A plugin written against the first release's documented API still loads and serves.

tests/fixtures/legacy_plugin/ is such a plugin (plugin API 1.0: `backplane.batch`, `backplane.memory`,
the first release's spec fields and hook). It is installed with pip like any third-party plugin; it
must load, serve a tiny-llama greedy generation equal to torch_native's on CPU, and warn only with
DeprecationWarnings that name each new import.
"""

from __future__ import annotations

import sys
import warnings

import pytest

from backplane import Engine, SamplingParams
from backplane.plugin.manager import load_plugins
from backplane.plugin.runtime import PluginRuntimeError, build
from backplane.plugin.selection import AttentionRequirements, select_attention_backend

CPU = dict(device="cpu", dtype="float32", load_format="dummy", disable_cuda_graph=True, seed=3)
PROMPTS = [[5, 9, 14, 3, 27, 8], [11, 2, 40], [7] * 13]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


def _tokens(outputs):
    return [out.token_ids for out in outputs]


def test_first_release_plugin_serves_with_deprecation_warnings_only(legacy_plugin, monkeypatch):
    monkeypatch.setenv("BACKPLANE_PLUGINS", legacy_plugin)
    for name in [m for m in sys.modules if m.startswith("backplane_legacy_plugin")]:
        monkeypatch.delitem(sys.modules, name)  # the deprecated imports run (and warn) in this test
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plugin_set = load_plugins(strict=True)
        engine = Engine("tiny-llama", attention_backend=legacy_plugin, **CPU)
        legacy = _tokens(engine.generate(input_ids=PROMPTS, sampling_params=GREEDY))
    info = next(p for p in plugin_set.plugins if p.name == legacy_plugin)
    assert info.api == "1.0" and info.error is None
    assert engine.runner.attn_choices["decode"].spec.name == legacy_plugin
    from_plugin = [w for w in caught if "backplane_legacy_plugin" in w.filename]
    assert sorted(str(w.message).split(" is deprecated")[0] for w in from_plugin) == [
        "backplane.batch.ForwardBatch", "backplane.batch.ForwardMode", "backplane.memory.TokenToKVPool"]
    assert all(w.category is DeprecationWarning and "import it as `from backplane import " in str(w.message)
               for w in from_plugin)
    reference = Engine("tiny-llama", attention_backend="torch_native", **CPU)
    assert legacy == _tokens(reference.generate(input_ids=PROMPTS, sampling_params=GREEDY))
    assert all(len(tokens) == GREEDY.max_new_tokens for tokens in legacy)


def test_deprecations_as_errors_fail_its_factory_in_one_line(legacy_plugin, monkeypatch):
    """With DeprecationWarning as an error (a plugin author's CI under -W error) the old imports
    fail when the factory runs; `build` reports it in one line naming the plugin and its file:line."""
    monkeypatch.setenv("BACKPLANE_PLUGINS", legacy_plugin)
    for name in [m for m in sys.modules if m.startswith("backplane_legacy_plugin")]:
        monkeypatch.delitem(sys.modules, name)
    registry = load_plugins(strict=True).registry
    choice = select_attention_backend(registry, legacy_plugin, AttentionRequirements("cpu", "float32", 64, ("decode",)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        with pytest.raises(PluginRuntimeError) as err:
            build(choice, None, kind="attention")
    message = str(err.value)
    assert message.startswith(f"plugin {legacy_plugin!r}: attention backend {legacy_plugin!r}: factory raised "
                              "DeprecationWarning: backplane.batch.ForwardBatch is deprecated")
    assert message.endswith("backend.py:7)") and "backplane_legacy_plugin" in message and "\n" not in message
