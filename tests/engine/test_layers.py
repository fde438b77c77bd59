"""The engine's packages are layered: text and the scheduler core sit below the front ends
(backplane.engine), and no import circle runs through any of them."""

from __future__ import annotations

from pathlib import Path

from backplane.testing.layering import import_cycles, import_graph

CORE = Path(__file__).resolve().parents[2] / "core"
BELOW_ENGINE = ("backplane.scheduler", "backplane.text", "backplane.config", "backplane.runtime")


def engine_edges(graph):
    """Imports from a package below the front ends up into backplane.engine (any kind)."""
    return [f"{e.source}:{e.line} imports {e.target}" for m, edges in graph.items() for e in edges
            if m.startswith(BELOW_ENGINE) and e.target.startswith("backplane.engine")]


def test_nothing_below_the_front_ends_imports_them():
    assert engine_edges(import_graph([(CORE, "backplane")])) == []


def test_no_circle_through_the_engine_packages():
    cycles = import_cycles(import_graph([(CORE, "backplane")]), ("module", "typing"))
    assert [c for c in cycles if any(m.startswith(("backplane.engine", *BELOW_ENGINE)) for m in c)] == []


def test_the_checks_see_a_planted_circle(tmp_path):
    pkg = tmp_path / "scheduler"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from backplane.scheduler.b import x\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from backplane.scheduler.a import y\nfrom backplane.engine.engine import Engine\n")
    eng = tmp_path / "engine"
    eng.mkdir()
    (eng / "__init__.py").write_text("")
    (eng / "engine.py").write_text("")
    graph = import_graph([(pkg, "backplane.scheduler"), (eng, "backplane.engine")])
    assert import_cycles(graph, ("module", "typing")) == [["backplane.scheduler.a", "backplane.scheduler.b"]]
    assert engine_edges(graph) == ["backplane.scheduler.b:4 imports backplane.engine.engine"]
