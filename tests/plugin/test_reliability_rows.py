"""docs/reliability.md, section "Plugins, round three": every row names tests that exist (P01...)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_plugin_rows_name_existing_tests():
    rows = re.findall(r"^\| (P\d+) \|.*\| ((?:`[^`]+::[^`]+`(?:, )?)+) \|$", (ROOT / "docs" / "reliability.md").read_text(), re.M)
    assert [r for r, _ in rows] == [f"P{i:02d}" for i in range(1, len(rows) + 1)] and len(rows) >= 13
    for row, tests in rows:
        for test in re.findall(r"`([^`]+::[^`]+)`", tests):
            path, name = test.split("::")
            assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), f"{row}: {test} does not exist"
