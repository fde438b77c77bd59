"""bench/host_step.py on CPU, tiny sizes: both decode-batch paths run and the persistent one is reported."""

from __future__ import annotations

import json

from helpers_bench import load_bench


def _load():
    return load_bench("host_step")


def test_smoke_run_reports_both_paths(tmp_path):
    bench = _load()
    out = tmp_path / "host_step.json"
    bench.main(["--batch-sizes", "1", "3", "--rounds", "2", "--steps", "4", "--warmup", "2", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["overlap"], r["batch_size"]) for r in rows] == [(True, 1), (True, 3), (False, 1), (False, 3)]
    for row in rows:
        assert all(row[f"{mode}_{what}_us"] > 0 for mode in ("list", "persistent") for what in ("step", "build"))


def test_a_round_times_every_step_and_build():
    bench = _load()
    ns = bench.parse_args(["--steps", "5", "--warmup", "2"])
    for reuse in (False, True):
        steps, builds = bench.timed_round(3, reuse, True, ns)
        assert len(steps) == len(builds) == 5
