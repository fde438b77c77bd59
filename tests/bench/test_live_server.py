"""backplane.testing.server.LiveServer, the launcher bench/serving.py and the server tests share: ready
when /health answers, stopped with its exit code, and a server that dies or hangs at startup raised as
ServerStartError with its last log lines, its process stopped."""

from __future__ import annotations

import subprocess
import tempfile

import httpx
import pytest

from backplane.testing import server as live
from backplane.testing.server import LiveServer, ServerStartError

TINY = ["--model", "tiny-llama", "--device", "cpu", "--attention-backend", "torch_native", "--max-total-tokens", "4096"]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@pytest.fixture
def started(monkeypatch) -> list[subprocess.Popen]:
    """Every process a LiveServer starts in the test."""
    procs, popen = [], subprocess.Popen

    def recording(*args, **kwargs):
        procs.append(popen(*args, **kwargs))
        return procs[-1]

    monkeypatch.setattr(subprocess, "Popen", recording)
    return procs


def test_serves_until_stopped_and_keeps_a_given_log(tmp_path):
    log = tmp_path / "serve.log"
    # NOTE: --engine-in-thread: the launcher sees one server process either way, and this one is ready
    # ~3 s sooner (no engine process to start); the server tests run the default mode
    with LiveServer(*TINY, "--engine-in-thread", log_path=log, env=ONE_THREAD) as server:
        assert server.url == f"http://127.0.0.1:{server.port}"
        assert httpx.get(f"{server.url}/health", trust_env=False).status_code == 200
        body = {"prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": True, "temperature": 0}
        assert httpx.post(f"{server.url}/v1/completions", json=body, trust_env=False).status_code == 200
        assert server.wait_metric('backplane_requests_finished_total{finish_reason="length"}', 1.0) == 1.0
        assert server.proc.poll() is None
    assert server.proc.returncode == 0 and server.stop() == 0  # SIGTERM drains and exits 0; stop again is harmless
    assert "tiny-llama" in log.read_text() and server.tail(1) == log.read_text().splitlines()[-1]


@pytest.mark.parametrize("keep_log", [True, False], ids=["log_path", "temporary-log"])
def test_a_server_that_dies_at_startup_raises_with_its_last_log_lines(keep_log, tmp_path, monkeypatch, started):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    log = tmp_path / "serve.log" if keep_log else None
    with pytest.raises(ServerStartError) as caught:
        LiveServer("--model", "no-such-model", "--device", "cpu", log_path=log, env=ONE_THREAD)
    message = str(caught.value)
    assert message.startswith("backplane serve exited with code 2 before /health answered; the last lines of its log")
    assert message.splitlines()[-1].endswith("presets: llama-3.1-8b, llama-3.2-1b, qwen2.5-0.5b, qwen3-0.6b, tiny-llama")
    assert "--model 'no-such-model'" in message and started[0].returncode == 2
    if keep_log:
        assert f"({log})" in message and "no-such-model" in log.read_text()
    assert list((tmp_path / "tmp").iterdir()) == []  # a temporary log is deleted


def test_a_server_not_ready_in_time_is_stopped(started):
    with pytest.raises(ServerStartError, match=r"did not answer 200 within the startup timeout of 0\.2 s"):
        LiveServer(*TINY, startup_timeout=0.2, env=ONE_THREAD)
    assert len(started) == 1 and started[0].poll() is not None  # SIGTERM while it loaded: not left running


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan")])
def test_a_bad_startup_timeout_is_one_line_and_starts_nothing(timeout, started):
    with pytest.raises(ValueError) as caught:
        LiveServer(*TINY, startup_timeout=timeout)
    assert str(caught.value) == f"startup_timeout: expected a positive number of seconds, got {timeout!r}"
    assert started == []


def test_missing_dependencies_names_the_distributions(monkeypatch):
    assert live.missing_dependencies() == []  # the dev extra has the serve extra and httpx
    found = live.importlib.util.find_spec
    monkeypatch.setattr(live.importlib.util, "find_spec",
                        lambda name: None if name in ("prometheus_client", "httpx") else found(name))
    assert live.missing_dependencies() == ["prometheus-client", "httpx"]
