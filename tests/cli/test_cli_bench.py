"""`backplane bench` (CPU): the one-batch report, LoRA adapters taken in turn, and the speculative
section with its acceptance length."""

from __future__ import annotations

import json

import pytest

from backplane.cli import main


def _bench_json(capsys, *extra: str) -> dict:
    code = main(["bench", "--model", "tiny-llama", "--device", "cpu", "--batch-size", "1", "3",
                 "--input-len", "16", "--output-len", "6", "--json", *extra])
    assert code == 0
    return json.loads(capsys.readouterr().out)


def test_report_has_a_row_per_batch_size(capsys):
    report = _bench_json(capsys)
    assert [(r["batch_size"], r["mode"]) for r in report["results"]] == [(1, "eager"), (3, "eager")]
    assert all(r["decode_step_ms"] > 0 and r["prefill_tok_s"] > 0 for r in report["results"])
    assert report["graph"] is None and "speculative" not in report


@pytest.mark.parametrize("algo, extra", [
    ("ngram", ["--speculative-num-draft-tokens", "4"]),
])
def test_speculative_section_reports_acceptance_length(capsys, algo, extra):
    report = _bench_json(capsys, "--speculative-algorithm", algo, *extra)
    spec = report["speculative"]
    assert spec["algorithm"] == algo and spec["num_draft_tokens"] == 4
    assert [r["batch_size"] for r in spec["results"]] == [1, 3]
    for row in spec["results"]:
        assert row["verify_steps"] > 0 and row["tok_s"] > 0
        assert 1.0 <= row["acceptance_length"] <= 4.0


def test_lora_adapters_serve_the_batch(capsys, tmp_path):
    from lora_helpers import make_lora_world

    world = make_lora_world(tmp_path)
    code = main(["bench", "--model", str(world.base_dir), "--device", "cpu", "--batch-size", "3", "--input-len", "8",
                 "--output-len", "3", "--json", "--lora-paths", *world.lora_paths(), "--max-loras-per-batch", "3"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["backends"]["lora"]["adapters"]) == set(world.adapter_dirs)
    assert report["results"][0]["batch_size"] == 3
