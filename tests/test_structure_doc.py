"""docs/structure.md names every package and top-level module of core/ and plugins/, and nothing that is gone."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tree() -> set[str]:
    paths = set()
    for top in ("core", "plugins"):
        for child in (ROOT / top).iterdir():
            if child.is_dir() and (child / "__init__.py").exists():
                paths.add(f"{top}/{child.name}/")
            elif child.suffix == ".py" and child.name != "__init__.py":
                paths.add(f"{top}/{child.name}")
    return paths


def _documented() -> set[str]:
    text = (ROOT / "docs" / "structure.md").read_text()
    return set(re.findall(r"^\| `((?:core|plugins)/[^`]*)`", text, flags=re.M))


def test_every_package_and_module_is_documented():
    missing = sorted(_tree() - _documented())
    assert not missing, f"docs/structure.md lacks a row for: {missing}"


def test_no_row_names_a_path_that_is_gone():
    gone = sorted(p for p in _documented() if not (ROOT / p.rstrip("/")).exists())
    assert not gone, f"docs/structure.md names paths that do not exist: {gone}"
