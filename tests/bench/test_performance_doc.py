"""docs/performance.md and bench/results/: every result file the page names exists, every section
with a table names one, every stored result is named on the page, and each file's name carries the
card, commit and date of its `meta`."""

from __future__ import annotations

import json
import re

import pytest

from helpers_bench import ROOT

PAGE = (ROOT / "docs" / "performance.md").read_text()
RESULTS = ROOT / "bench" / "results"
NAMED = set(re.findall(r"bench/results/([\w.-]+\.json)", PAGE))


def sections() -> dict[str, str]:
    parts = re.split(r"^## (.+)$", PAGE, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_every_named_result_file_exists():
    assert NAMED, "docs/performance.md names no result file"
    assert not sorted(n for n in NAMED if not (RESULTS / n).is_file())


@pytest.mark.parametrize("title", [t for t, body in sections().items() if re.search(r"^\| ", body, flags=re.M)])
def test_every_table_section_names_its_result_file(title):
    assert re.search(r"bench/results/[\w.-]+\.json", sections()[title]), f"section {title!r} names no result file"


def test_every_stored_result_is_named_on_the_page():
    assert not sorted(p.name for p in RESULTS.glob("*.json") if p.name not in NAMED)


@pytest.mark.parametrize("name", sorted(p.name for p in RESULTS.glob("*.json")))
def test_a_result_file_name_ends_with_its_card_commit_and_date(name):
    meta = json.loads((RESULTS / name).read_text())["meta"]
    assert name.endswith(f"-{meta['card']}-{meta['commit']}-{meta['date']}.json")
    assert meta["device"] and meta["torch"]
