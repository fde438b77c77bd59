"""bench/run.py on CPU: every group names tests and benchmarks that exist; jobs share one deadline
(interrupted at it, not started past it), `together` jobs run at the same time; the matrix merge."""

from __future__ import annotations

import importlib
import importlib.util
import json
import time

import pytest

from helpers_bench import ROOT
from bench import run


@pytest.mark.parametrize("group", list(run.GROUPS))
def test_every_job_of_a_group_names_what_exists(group):
    for job in run.GROUPS[group]:
        assert job.argv[0] == "-m", job
        if job.argv[1] == "pytest":
            paths = [a for a in job.argv if a.startswith("tests/")]
            assert paths and all((ROOT / p.split("::")[0]).exists() for p in paths), job
        else:
            assert importlib.util.find_spec(job.argv[1]) is not None, job
    assert not run.GROUPS[group][-1].together, "a group's last job must be waited for"


@pytest.mark.parametrize("job", [j for jobs in run.GROUPS.values() for j in jobs if j.argv[1].startswith("bench.")],
                         ids=lambda job: job.name)
def test_every_benchmark_job_passes_arguments_its_benchmark_accepts(job):
    module = importlib.import_module(job.argv[1])
    assert module.parse_args(list(job.argv[2:])) is not None  # argparse exits on an unknown or malformed flag


def sleeper(name: str, seconds: float, together: bool = False) -> run.Job:
    return run.Job(name, ("-c", f"import time; print('{name} ran'); time.sleep({seconds})"), together=together)


def test_together_jobs_run_at_the_same_time(tmp_path):
    start = time.monotonic()
    rows = run.run_group([sleeper("a", 1.5, together=True), sleeper("b", 1.5)], tmp_path, time.monotonic() + 60)
    assert [(r["job"], r["rc"], r["last"]) for r in rows] == [("a", 0, "a ran"), ("b", 0, "b ran")]
    assert time.monotonic() - start < 2.8


def test_the_deadline_interrupts_a_job_and_leaves_the_next_unstarted(tmp_path, monkeypatch):
    monkeypatch.setattr(run, "MIN_JOB_S", 1)
    rows = run.run_group([sleeper("slow", 60), sleeper("next", 0)], tmp_path, time.monotonic() + 2)
    assert rows[0]["rc"] != 0 and rows[0]["seconds"] < 10
    assert rows[1] == {"job": "next", "rc": None, "seconds": 0, "last": "not started: the budget is spent"}


def test_out_placeholders_name_the_group_folder(tmp_path):
    job = run.Job("w", ("-c", "import os, sys; open(sys.argv[1], 'w').write(os.environ['WHERE'])", "{out}/x.txt"),
                  env=(("WHERE", "{out}"),))
    assert run.run_group([job], tmp_path, time.monotonic() + 60)[0]["rc"] == 0
    assert (tmp_path / "x.txt").read_text() == str(tmp_path)


def test_matrix_shards_merge_into_one_summary(tmp_path):
    cell = {"label": "c", "status": "ok", "message": "", "seconds": 1.0, "ties": []}
    for i, status in enumerate(("ok", "refused")):
        (tmp_path / f"matrix-{i}.json").write_text(json.dumps({"results": [cell | {"label": f"c{i}", "status": status}]}))
    assert run.merge_matrix(tmp_path) == "matrix: 2 cells: 1 ok, 0 tie, 1 refused, 0 mismatch, 0 error"
    merged = json.loads((tmp_path / "matrix.json").read_text())
    assert merged["cells"] == 2 and merged["refusals"] == {"c1": ""} and merged["seconds"] == 2.0


def test_an_unknown_group_lists_the_groups(capsys):
    assert run.main(["no-such-group"]) == 2
    assert "decode-1b:" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["decode", "prefill", "ttft", "e2e", "serving", "lora", "spec", "attention", "lora_kernels", "ops", "moe_layer", "moe_decode", "quant_kernels", "run"])
def test_every_benchmark_imports_and_answers_help_without_a_gpu(name, capsys):
    with pytest.raises(SystemExit) as stop:
        importlib.import_module(f"bench.{name}").main(["--help"])
    assert stop.value.code == 0 and "usage:" in capsys.readouterr().out
