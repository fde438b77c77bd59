"""docs/structure.md has one row per module of core/ and plugins/ (a package's row is its `__init__.py`),
each with its import name, each deprecated alias marked as such, and no row for a module that is gone.

Reads files only (no import), so it stays fast."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMPORT_ROOTS = {"core": "backplane", "plugins": "backplane.plugins"}
ROW = re.compile(r"^\| `((?:core|plugins)/[^`]*)` \| `([^`]+)` \| (.+) \|$", re.M)


def module_paths(root: Path) -> set[str]:
    """Every module under core/ and plugins/ as a row names it: `core/x/y.py`, or `core/x/` for a package."""
    paths = set()
    for top in IMPORT_ROOTS:
        for path in (root / top).rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            rel = path.relative_to(root).as_posix()
            paths.add(rel.removesuffix("__init__.py"))
    return paths


def rows(text: str) -> list[tuple[str, str, str]]:
    """(path, import name, description) of every module row of the page, in order."""
    return ROW.findall(text)


def import_name(path: str) -> str:
    """`core/x/y.py` -> `backplane.x.y`; `plugins/a/` -> `backplane.plugins.a`."""
    top, _, rest = path.partition("/")
    parts = [p for p in rest.removesuffix(".py").split("/") if p]
    return ".".join([IMPORT_ROOTS[top], *parts])


def is_deprecated_alias(root: Path, path: str) -> bool:
    """A module whose docstring starts "Deprecated:" or "Deprecated alias" (as every alias module's does)."""
    file = root / (path + "__init__.py" if path.endswith("/") else path)
    doc = ast.get_docstring(ast.parse(file.read_text())) or ""
    return re.match(r"Deprecated(:| alias)", doc) is not None


def problems(root: Path, text: str) -> list[str]:
    """Every way the page disagrees with the tree under `root`, one line each."""
    found, tree = rows(text), module_paths(root)
    documented = {path: (name, what) for path, name, what in found}
    out = [f"more than one row for {p}" for p in sorted(documented) if [r[0] for r in found].count(p) > 1]
    out += [f"no row for {p}" for p in sorted(tree - set(documented))]
    out += [f"row for {p}, which does not exist" for p in sorted(set(documented) - tree)]
    for path in sorted(set(documented) & tree):
        name, what = documented[path]
        if name != import_name(path):
            out.append(f"{path}: import name `{name}`, expected `{import_name(path)}`")
        if is_deprecated_alias(root, path) and "deprecated alias" not in what:
            out.append(f"{path}: a deprecated alias whose row does not say 'deprecated alias'")
    return out


def test_every_module_has_a_true_row():
    found = problems(ROOT, (ROOT / "docs" / "structure.md").read_text())
    assert not found, "docs/structure.md: " + "; ".join(found)


def _planted_tree(tmp_path: Path) -> Path:
    for rel, doc in [("core/__init__.py", "Root."), ("core/pkg/__init__.py", "A package."),
                     ("core/pkg/mod.py", "A module."), ("core/pkg/old.py", "Deprecated: moved to x."),
                     ("core/pkg/deprecation.py", "Deprecated public names: the registry."),
                     ("plugins/__init__.py", "")]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(f'"""{doc}"""\n')
    (tmp_path / "core" / "pkg" / "__pycache__").mkdir()
    (tmp_path / "core" / "pkg" / "__pycache__" / "mod.py").write_text("")
    return tmp_path


GOOD = """| path | import name | what it holds |
| --- | --- | --- |
| `core/` | `backplane` | root |
| `core/pkg/` | `backplane.pkg` | a package |
| `core/pkg/mod.py` | `backplane.pkg.mod` | a module |
| `core/pkg/deprecation.py` | `backplane.pkg.deprecation` | the registry of moved names |
| `core/pkg/old.py` | `backplane.pkg.old` | *deprecated alias* of x |
| `plugins/` | `backplane.plugins` | plugins |
"""


def test_a_complete_page_of_a_planted_tree_passes(tmp_path):
    assert problems(_planted_tree(tmp_path), GOOD) == []


def test_a_planted_missing_row_is_seen(tmp_path):
    text = GOOD.replace("| `core/pkg/mod.py` | `backplane.pkg.mod` | a module |\n", "")
    assert problems(_planted_tree(tmp_path), text) == ["no row for core/pkg/mod.py"]


def test_a_row_for_a_gone_module_and_a_second_row_are_seen(tmp_path):
    text = GOOD + "| `core/pkg/gone.py` | `backplane.pkg.gone` | gone |\n| `core/` | `backplane` | again |\n"
    assert problems(_planted_tree(tmp_path), text) == ["more than one row for core/",
                                                       "row for core/pkg/gone.py, which does not exist"]


def test_a_wrong_import_name_and_an_unmarked_alias_are_seen(tmp_path):
    text = GOOD.replace("`backplane.pkg.mod`", "`backplane.mod`").replace("*deprecated alias* of x", "old things")
    assert problems(_planted_tree(tmp_path), text) == [
        "core/pkg/mod.py: import name `backplane.mod`, expected `backplane.pkg.mod`",
        "core/pkg/old.py: a deprecated alias whose row does not say 'deprecated alias'",
    ]
