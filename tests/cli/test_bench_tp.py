"""`backplane bench --tp-size 2` on CPU (gloo): the eager decode rows go through the tensor-parallel
router, so the command finishes instead of leaving rank 0 in all_reduce and rank 1 waiting for a
batch. Run as a subprocess with a timeout, so a hang fails the test."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HANG_S = 180  # the worker forkserver starts in ~10 s; a run of this size takes a few seconds more


def test_bench_tp2_finishes():
    cmd = [sys.executable, "-m", "backplane.cli", "bench", "--model", "tiny-llama", "--device", "cpu",
           "--dtype", "float32", "--batch-size", "2", "--input-len", "8", "--output-len", "3",
           "--max-total-tokens", "256", "--tp-size", "2", "--json"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"bench --tp-size 2 still running after {HANG_S} s (hang in the eager decode)")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(done.stdout[done.stdout.index("{"):])["results"]
    assert [(r["batch_size"], r["mode"]) for r in rows] == [(2, "eager")]
    assert rows[0]["decode_step_ms"] > 0
