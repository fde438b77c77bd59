"""bench/report.py: result files named and stamped by card, commit and date; ratios; the table printer."""

from __future__ import annotations

import json
import subprocess

import pytest

import helpers_bench  # noqa: F401 - the repository root on sys.path
from bench import report


@pytest.mark.parametrize("name, want", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("cpu", "cpu"),
                                        ("NVIDIA A100-SXM4-80GB", "a100"), ("", "unknown")])
def test_card_is_the_short_name_of_the_device(name, want):
    assert report.card(name) == want


def test_commit_without_git_comes_from_the_environment_or_is_unknown(monkeypatch):
    def no_git(*args, **kwargs):
        raise OSError("no git here")

    monkeypatch.setattr(subprocess, "run", no_git)
    monkeypatch.delenv(report.COMMIT_ENV, raising=False)
    assert report.commit() == "unknown"
    monkeypatch.setenv(report.COMMIT_ENV, "abc1234")
    assert report.commit() == "abc1234"


def test_the_named_commit_wins_over_a_stale_git(monkeypatch):
    """The GPU machine's tree described an older commit with -dirty while the named one was right."""
    monkeypatch.setattr(subprocess, "run", lambda *a, **kw: subprocess.CompletedProcess(a, 0, "fcd7efd-dirty\n", ""))
    monkeypatch.delenv(report.COMMIT_ENV, raising=False)
    assert report.commit() == "fcd7efd-dirty"
    monkeypatch.setenv(report.COMMIT_ENV, "ccd375d")
    assert report.commit() == "ccd375d"


def test_a_result_names_card_commit_and_date_in_its_file_and_payload(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "commit", lambda: "abc1234")
    path = report.write_result("decode", "tiny-llama", {"rows": [1]}, tmp_path, "cpu")
    doc = json.loads(path.read_text())
    meta = doc["meta"]
    assert path.name == f"decode-tiny-llama-cpu-abc1234-{meta['date']}.json" and doc["rows"] == [1]
    assert meta["card"] == "cpu" and meta["device"] == "cpu" and meta["commit"] == "abc1234" and meta["torch"]
    monkeypatch.setenv("OUT", str(tmp_path / "out"))  # on the GPU machine results go to $OUT
    assert report.write_result("e2e", "x", {}, device="cpu").parent == tmp_path / "out"


def test_ratios_side_by_side_are_none_when_a_figure_is_missing():
    rows = report.add_ratios([{"a": 3.0, "b": 2.0}, {"a": 3.0, "b": None}, {"a": None, "b": 0.0}], {"r": ("a", "b")})
    assert [r["r"] for r in rows] == [1.5, None, None]


def test_the_table_aligns_columns_formats_numbers_and_dashes_missing_cells():
    text = report.table([{"name": "triton", "ms": 1.23456}, {"name": "flashinfer"}],
                        [("backend", "name", ""), ("ms", "ms", ".2f")], "title")
    assert text.splitlines() == ["title", "   backend    ms", "    triton  1.23", "flashinfer     -"]


def test_verdicts():
    assert [report.verdict(1.1, 1.15), report.verdict(1.2, 1.15), report.verdict(None, 1.0),
            report.verdict(0.95, 0.9, at_most=False)] == ["met", "MISSED", "n/a", "met"]
