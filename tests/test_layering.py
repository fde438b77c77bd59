"""The house's import graph: no circle anywhere in backplane (module-level, TYPE_CHECKING and
function-level imports alike), and nothing in the contracts (backplane.contracts) imports anything
of backplane above it. Both checks are shown to fail on planted violations."""

from __future__ import annotations

from pathlib import Path

from backplane.testing.layering import climbing_imports, import_cycles, import_graph

ROOT = Path(__file__).resolve().parents[1]
ALL_KINDS = ("module", "typing", "lazy")


def house():
    return import_graph([(ROOT / "core", "backplane"), (ROOT / "plugins", "backplane.plugins")])


def test_no_import_circle_in_backplane():
    graph = house()
    assert len(graph) > 150 and "backplane.contracts.batch" in graph  # the whole tree was read
    assert import_cycles(graph, ALL_KINDS) == []


def test_the_contracts_import_nothing_above_them():
    graph = house()
    assert any(e.target == "backplane.contracts.batch" for e in graph["backplane.contracts.attention"])
    assert climbing_imports(graph, "backplane.contracts") == []


def _plant(tmp_path: Path, files: dict[str, str]) -> dict:
    for name, text in files.items():
        path = tmp_path / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return import_graph([(tmp_path / "pkg", "backplane")])


def test_planted_violations_are_seen(tmp_path):
    graph = _plant(tmp_path, {
        "__init__.py": "",
        "contracts/__init__.py": "",
        "contracts/batch.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from backplane.executor.runner import X\n",
        "executor/__init__.py": "",
        "executor/runner.py": "from backplane.contracts.batch import Y\n\ndef f():\n    from backplane.engine import loop\n",
        "engine/__init__.py": "",
        "engine/loop.py": "from ..executor import runner\n",
    })
    assert climbing_imports(graph, "backplane.contracts") == [
        "backplane.contracts.batch:3 imports backplane.executor.runner (typing)"]
    # circles through TYPE_CHECKING and function-level imports are still circles; module-level imports
    # alone have none here
    assert import_cycles(graph, ALL_KINDS) == [
        ["backplane.contracts.batch", "backplane.engine.loop", "backplane.executor.runner"]]
    assert import_cycles(graph, ("module", "lazy")) == [["backplane.engine.loop", "backplane.executor.runner"]]
    assert import_cycles(graph, ("module",)) == []
