"""The bundled plugins import only backplane's public API (docs/plugins.md, "Public API")."""

from pathlib import Path

import pytest

import backplane
import backplane.plugins
from backplane.testing.boundary import PUBLIC_MODULES, check_plugin_imports, import_violation

PLUGINS_DIR = Path(backplane.plugins.__file__).parent
BUNDLED = sorted(p.name for p in PLUGINS_DIR.iterdir() if (p / "__init__.py").exists())


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_plugin_imports_only_public_api(name):
    assert check_plugin_imports(PLUGINS_DIR / name, f"backplane.plugins.{name}") == []


def test_every_bundled_plugin_is_checked():
    assert set(BUNDLED) >= {"attention_triton", "attention_flashinfer", "lora_triton", "spec_eagle", "spec_ngram"}


@pytest.mark.parametrize(
    "source, fragment",
    [
        ("from backplane.contracts.batch import ForwardBatch", "private module 'backplane.contracts.batch'"),
        ("import backplane.plugin.registry", "private module 'backplane.plugin.registry'"),
        ("from backplane.lora import LoraManager", "does not export them"),
        ("from backplane.plugins.attention_triton import kernels", "another plugin's module"),
        ("def f():\n    from backplane.executor.graph_runner import pool_bytes", "private module"),
    ],
)
def test_a_bad_import_is_reported(tmp_path, source, fragment):
    plugin = tmp_path / "bad_plugin"
    plugin.mkdir()
    (plugin / "__init__.py").write_text("from backplane import hookimpl\n" + source + "\n")
    problems = check_plugin_imports(plugin, "backplane.plugins.bad_plugin")
    assert len(problems) == 1 and fragment in problems[0], problems
    assert f"__init__.py:{2 + source.count(chr(10))}:" in problems[0]


def test_public_names_and_own_package_are_allowed():
    own = "backplane.plugins.mine"
    assert import_violation("backplane", ("ForwardBatch", "hookimpl"), own) is None
    assert import_violation("backplane.ops", ("native",), own) is None
    assert import_violation("backplane.plugins.mine.kernels", ("decode",), own) is None
    assert import_violation("torch", ("nn",), own) is None


def test_public_modules_import():
    import importlib

    for module in PUBLIC_MODULES:
        importlib.import_module(module)


LLAMA = Path(backplane.__file__).parent / "models" / "llama.py"


def _as_plugin(tmp_path, source: str) -> Path:
    """A plugin package holding `source` as its model module, as a third-party model plugin would."""
    plugin = tmp_path / "llama_plugin"
    plugin.mkdir()
    (plugin / "__init__.py").write_text("")
    (plugin / "llama.py").write_text(source)
    return plugin


def test_the_bundled_llama_family_builds_only_on_the_public_model_api(tmp_path):
    plugin = _as_plugin(tmp_path, LLAMA.read_text())
    assert check_plugin_imports(plugin, "backplane.plugins.llama_plugin") == []


def test_a_private_import_planted_in_llama_fails_the_check(tmp_path):
    planted = "from backplane.layers.rotary import RotaryEmbedding\n" + LLAMA.read_text()
    problems = check_plugin_imports(_as_plugin(tmp_path, planted), "backplane.plugins.llama_plugin")
    assert len(problems) == 1 and "private module 'backplane.layers.rotary'" in problems[0], problems
    assert "llama.py:1: " in problems[0], problems
