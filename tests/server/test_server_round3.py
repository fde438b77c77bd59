"""The server's answers to issue 42, against a live `backplane serve`: 401 carries WWW-Authenticate,
a 200,000-deep JSON body is a 400, seed 2**64-1 with n 2 is served, an oversized max_tokens names
max_tokens and no request counter, every request has an access-log line and every 4xx a warning,
/metrics has no `_created` series; startup refuses --api-key '', --max-queued-requests 0 and an
address it cannot listen on before any model loads; SIGTERM with streams in flight exits within
--shutdown-timeout + 0.5 s, and an idle server exits promptly."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx
import pytest

from helpers_server import TINY, LiveServer

KEY = "sk-round3"
AUTH = {"Authorization": f"Bearer {KEY}"}
SHUTDOWN_TIMEOUT = 2.0


@pytest.fixture(scope="module")
def server():
    live = LiveServer(*TINY, "--api-key", KEY, "--max-total-tokens", "4096", "--log-level", "info",
                      "--shutdown-timeout", str(SHUTDOWN_TIMEOUT))
    yield live
    live.stop()


def post(server, body, headers=AUTH):
    return httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60)


def test_401_carries_www_authenticate(server):
    r = post(server, {"prompt": [1, 2], "max_tokens": 2}, headers={})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"


def test_deeply_nested_json_is_a_400(server):
    body = "[" * 200_000 + "]" * 200_000
    r = httpx.post(f"{server.url}/v1/completions", content=body, headers={**AUTH, "content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 400 and "nested deeper" in r.json()["error"]["message"]


def test_largest_seed_with_two_choices(server):
    r = post(server, {"prompt": [1, 5, 6], "max_tokens": 3, "n": 2, "seed": 2**64 - 1, "temperature": 1.0})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2
    r = post(server, {"prompt": [1, 5, 6], "max_tokens": 3, "seed": 2**64})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"


def test_oversized_max_tokens_names_max_tokens_without_a_request_number(server):
    r = post(server, {"prompt": [1, 5, 6], "max_tokens": 10**6})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "max_tokens"
    assert "max_tokens 1000000" in error["message"] and not error["message"].startswith("request ")


def test_access_log_and_4xx_lines(server):
    post(server, {"prompt": [1, 2], "max_tokens": 2})
    post(server, {"prompt": [1, 2], "max_tokens": 2}, headers={})
    log = server.output()
    assert '"POST /v1/completions" 200' in log and '"POST /v1/completions" 401' in log
    assert "POST /v1/completions -> 401: missing or wrong API key" in log


def test_metrics_have_no_created_series(server):
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    assert "backplane_prompt_tokens_total" in text and "_created" not in text


@pytest.mark.parametrize("argv, message", [
    (["--api-key", ""], "--api-key (env BACKPLANE_API_KEY): invalid value '': expected a non-empty key"),
    (["--max-queued-requests", "0"], "--max-queued-requests (env BACKPLANE_MAX_QUEUED_REQUESTS): invalid value"),
    (["--host", "999.1.1.1"], "--host 999.1.1.1 --port 8000: cannot listen there"),
])
def test_startup_refusals_are_one_line_before_the_model(argv, message):
    # a model that would fail to load shows that the refusal comes first
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "backplane.cli", "serve", "--model", "/nonexistent", *argv],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
    assert time.monotonic() - start < 60


def stream_in_background(url: str, started: threading.Event) -> None:
    body = {"prompt": [1, 5, 6], "max_tokens": 1900, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    started.set()
    except httpx.HTTPError:
        pass


def test_sigterm_exit_is_bounded_by_the_shutdown_timeout():
    num_streams = 4
    live = LiveServer(*TINY, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT), "--max-total-tokens", "16384")
    try:
        events = [threading.Event() for _ in range(num_streams)]
        threads = [threading.Thread(target=stream_in_background, args=(live.url, e), daemon=True) for e in events]
        for t in threads:
            t.start()
        assert all(e.wait(60) for e in events)
        code, elapsed = _timed_terminate(live)
    finally:
        live.stop()
    assert code == 0, live.output()
    limit = SHUTDOWN_TIMEOUT + 0.5
    assert elapsed <= limit, f"exit took {elapsed:.2f} s with {num_streams} streams (limit {limit} s)"


def test_an_idle_server_exits_promptly(server):  # must run last in this module: it stops the module's server
    """The same SIGTERM with no stream in flight (every request above has finished) exits well within
    --shutdown-timeout. (The module's server, not a fresh one: a server start costs the CPU suite ~6 s.)"""
    code, elapsed = _timed_terminate(server)
    assert code == 0, server.output()
    assert elapsed <= 1.5, f"exit took {elapsed:.2f} s with no stream (limit 1.5 s)"


def _timed_terminate(live: LiveServer) -> tuple[int, float]:
    start = time.monotonic()
    code = live.terminate(timeout=30)
    return code, time.monotonic() - start
