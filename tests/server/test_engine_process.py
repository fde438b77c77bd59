"""`backplane serve` runs its engine in a child process: the pid differs, the engine dies with the
server, an engine that dies fails its requests and /health, startup errors read as before, and
--engine-in-thread still serves from one process; both modes serve the offline Engine's tokens."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from backplane import Engine, SamplingParams
from backplane.engine.engine_process import EXIT_GRACE_S
from helpers_server import TINY, LiveServer

LONG = {"prompt": [1, 5, 6], "max_tokens": 1900, "ignore_eos": True, "temperature": 0, "stream": True}
SHORT = {"prompt": [1, 40, 41, 42], "max_tokens": 6, "ignore_eos": True, "temperature": 0,
         "return_token_ids": True}


def _engine_pid(server: LiveServer) -> int:
    return httpx.get(f"{server.url}/health", timeout=5).json()["engine_pid"]


def _alive(pid: int) -> bool:
    """True while `pid` runs (a zombie nobody has reaped yet counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rpartition(")")[2].split()[1])


@pytest.fixture
def server():
    live = LiveServer(*TINY)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def reference():
    """SHORT's greedy output from an offline Engine on TINY's model and flags: what the server serves
    in either mode. (One reference for both modes instead of a second server: a server start costs
    the CPU suite ~6 s.)"""
    engine = Engine("tiny-llama", device="cpu", attention_backend="torch_native", max_total_tokens=16384)
    params = SamplingParams(max_new_tokens=SHORT["max_tokens"], temperature=0.0, ignore_eos=True)
    return engine.generate(input_ids=[SHORT["prompt"]], sampling_params=params)[0]


def test_the_engine_runs_in_a_child_process_and_stops_with_sigterm(server, reference):  # R71
    pid = _engine_pid(server)
    assert pid != server.proc.pid and _parent_of(pid) == server.proc.pid
    r = httpx.post(f"{server.url}/v1/completions", json=SHORT, timeout=30)
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 6
    out = r.json()["choices"][0]
    assert out["token_ids"] == reference.token_ids and out["text"] == reference.text
    assert server.terminate() == 0, server.output()
    assert _wait_gone(pid, 5.0)


def test_killing_the_server_leaves_no_engine_process(server):  # R71
    pid = _engine_pid(server)
    server.proc.kill()  # SIGKILL: no shutdown code runs; the engine process sees its pipe close
    server.proc.wait()
    assert _wait_gone(pid, EXIT_GRACE_S + 5.0), "the engine process outlived its server"


def test_a_dead_engine_fails_requests_in_flight_and_health(server):  # R70
    pid = _engine_pid(server)
    with httpx.stream("POST", f"{server.url}/v1/completions", json=LONG, timeout=30) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        os.kill(pid, signal.SIGKILL)
        rest = [line for line in lines if line]
    assert len(rest) < 1900 and rest[-1] == "data: [DONE]"
    assert "the engine process exited unexpectedly (exit code -9)" in rest[-2] and '"code":500' in rest[-2]
    health = httpx.get(f"{server.url}/health", timeout=5)
    assert health.status_code == 503 and "exited unexpectedly" in health.json()["error"]["message"]
    late = httpx.post(f"{server.url}/v1/completions", json=SHORT, timeout=30)
    assert late.status_code == 503 and "the engine has stopped" in late.json()["error"]["message"]
    assert server.terminate() == 0, server.output()


def test_engine_in_thread_serves_the_same_tokens(reference):
    """The same tokens and text as the offline Engine, which the child-process server serves too
    (test_the_engine_runs_in_a_child_process_and_stops_with_sigterm)."""
    threaded = LiveServer(*TINY, "--engine-in-thread")
    try:
        assert _engine_pid(threaded) == threaded.proc.pid
        out = httpx.post(f"{threaded.url}/v1/completions", json=SHORT, timeout=30).json()["choices"][0]
        assert out["token_ids"] == reference.token_ids and out["text"] == reference.text
        assert threaded.terminate() == 0, threaded.output()
    finally:
        threaded.stop()


@pytest.mark.parametrize("flags", [["--model", "/nonexistent"], [*TINY, "--speculative-algorithm", "bogus"]],
                         ids=["model", "plugin"])
def test_startup_errors_read_the_same_in_both_modes(flags):  # R72
    def serve(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "backplane.cli", "serve", "--port", "0", *flags, *extra],
                              capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})

    split, threaded = serve(), serve("--engine-in-thread")
    assert split.returncode == threaded.returncode == 2
    assert split.stderr == threaded.stderr and split.stderr.count("\n") == 1, split.stderr
    assert split.stderr.startswith("backplane: error: ")
