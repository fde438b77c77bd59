"""docs/reliability.md: every row of the round-two table names tests that exist (R47 onwards), and so do the
round-three tables (S01..., E01...); every test and repository path the page names anywhere exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAMED_TEST = re.compile(r"`([\w/.-]+\.py)::(\w+)`")
BARE_TEST = re.compile(r"`(test_\w+)`")
REPO_PATH = re.compile(r"(?<![\w/.-])((?:tests|bench|docs|core|plugins)/[\w/.-]*\w/?)")


def _page() -> str:
    return (ROOT / "docs" / "reliability.md").read_text()


def _rows(prefix: str, text: str) -> list[tuple[str, list[str]]]:
    """(row id, its `file::test` names) for every table row whose id is `prefix` and digits."""
    rows = []
    for line in text.splitlines():
        match = re.match(rf"\| ({prefix}\d+) \|.*\| ((?:`[^`]+::[^`]+`(?:, )?)+) \|$", line)
        if match:
            rows.append((match.group(1), re.findall(r"`([^`]+::[^`]+)`", match.group(2))))
    return rows


def defines(source: str, name: str) -> bool:
    return re.search(rf"^(?:async )?def {name}\(", source, re.M) is not None


def missing_names(text: str, root: Path) -> list[str]:
    """Every `file::test`, bare `test_...` and repository path in `text` that `root` does not have."""
    out = []
    for path, name in NAMED_TEST.findall(text):
        file = root / path
        if not file.is_file() or not defines(file.read_text(), name):
            out.append(f"{path}::{name}")
    bare = set(BARE_TEST.findall(text))
    if bare:
        sources = "\n".join(p.read_text() for p in (root / "tests").rglob("test_*.py"))
        out += sorted(name for name in bare if not defines(sources, name))
    out += sorted({p for p in REPO_PATH.findall(text) if not (root / p.split("::")[0]).exists()})
    return out


def test_round_two_rows_name_existing_tests():
    rows = _rows("R", _page())
    ids = [r for r, _ in rows]
    assert ids == [f"R{i}" for i in range(47, 47 + len(ids))] and len(ids) >= 22, ids
    for row, tests in rows:
        for test in tests:
            path, name = test.split("::")
            source = (ROOT / path).read_text()
            assert defines(source, name), f"{row}: {test} does not exist"
            assert f"{row}" in source, f"{row}: {path} does not mention the row"


def test_round_three_rows_are_numbered_and_name_tests():
    for prefix, at_least in (("S", 26), ("E", 7)):
        rows = _rows(prefix, _page())
        ids = [r for r, _ in rows]
        assert ids == [f"{prefix}{i:02d}" for i in range(1, len(ids) + 1)] and len(ids) >= at_least, ids
        assert all(tests for _, tests in rows)


def test_every_test_and_path_the_page_names_exists():
    assert missing_names(_page(), ROOT) == []


def test_a_planted_gone_test_and_stale_path_are_seen(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("def test_here():\n    pass\n\n\nasync def test_async():\n    pass\n")
    (tmp_path / "bench" / "results").mkdir(parents=True)
    text = ("| X01 | `tests/test_a.py::test_here`, `tests/test_a.py::test_async`, `tests/test_a.py::test_gone` |\n"
            "`test_here` and `test_nowhere`; results in bench/results/, run by `bench/gpu_suite.sh matrix`\n")
    assert missing_names(text, tmp_path) == ["tests/test_a.py::test_gone", "test_nowhere", "bench/gpu_suite.sh"]
