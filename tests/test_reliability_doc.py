"""docs/reliability.md: every row of the round-two table names tests that exist (R47 onwards)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rows() -> list[tuple[str, list[str]]]:
    table = (ROOT / "docs" / "reliability.md").read_text()
    rows = []
    for line in table.splitlines():
        match = re.match(r"\| (R\d+) \|.*\| ((?:`[^`]+::[^`]+`(?:, )?)+) \|$", line)
        if match:
            rows.append((match.group(1), re.findall(r"`([^`]+::[^`]+)`", match.group(2))))
    return rows


def test_round_two_rows_name_existing_tests():
    rows = _rows()
    ids = [r for r, _ in rows]
    assert ids == [f"R{i}" for i in range(47, 47 + len(ids))] and len(ids) >= 22, ids
    for row, tests in rows:
        for test in tests:
            path, name = test.split("::")
            source = (ROOT / path).read_text()
            assert re.search(rf"^def {name}\(", source, re.M), f"{row}: {test} does not exist"
            assert f"{row}" in source, f"{row}: {path} does not mention the row"
