"""Speculative decoding sits below the engine: nothing in core/speculative imports backplane.engine
(the engine imports speculative decoding; the reverse edge would be a cycle)."""

from __future__ import annotations

import ast
from pathlib import Path

SPECULATIVE = Path(__file__).resolve().parents[2] / "core" / "speculative"


def engine_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):  # function-local imports included
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        found += [f"{path.name}:{node.lineno} imports {n}" for n in names if n.split(".")[:2] == ["backplane", "engine"]]
    return found


def test_speculative_never_imports_the_engine():
    files = sorted(SPECULATIVE.glob("*.py"))
    assert len(files) >= 6
    assert [hit for f in files for hit in engine_imports(f)] == []


def test_the_check_sees_a_function_local_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from backplane.engine.batch_builder import build_decode_batch\n")
    assert engine_imports(bad) == ["bad.py:2 imports backplane.engine.batch_builder"]
