"""bench/host_step.py on CPU, tiny sizes: both decode-batch paths run and the persistent one is reported."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "host_step.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_host_step", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


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
