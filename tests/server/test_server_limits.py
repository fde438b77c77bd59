"""A live server with an API key (from BACKPLANE_API_KEY), one request row, a queue of one and no
chat template: 401 without the key, 503 with Retry-After past the queue, a 400 for chat, and
SIGTERM with a stream in flight exits cleanly. Also: `backplane serve` without the serve extra."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx
import pytest

from helpers_server import TINY, LiveServer

KEY = "sk-test-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = {"prompt": [1, 5, 6], "max_tokens": 1900, "ignore_eos": True, "temperature": 0, "stream": True}
# The rows of docs/reliability.md's HTTP section that need this server (ids follow test_openai_server's).
LIMIT_ROWS = {
    "H26": "no Authorization header -> 401",
    "H27": "a wrong key -> 401",
    "H28": "chat on a model without a chat template -> 400",
    "H29": "past --max-queued-requests -> 503 with Retry-After",
    "H30": "SIGTERM with a stream in flight -> exit 0",
}


@pytest.fixture(scope="module")
def server():
    live = LiveServer(*TINY, "--max-running-requests", "1", "--max-queued-requests", "1",
                      "--shutdown-timeout", "1", env={"BACKPLANE_API_KEY": KEY})
    yield live
    live.stop()


def _post(server, path, body, headers=AUTH, **kw):
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=30, **kw)


@pytest.mark.parametrize("row, headers", [("H26", {}), ("H27", {"Authorization": "Bearer wrong"})], ids=["H26", "H27"])
def test_api_key_required(row, headers, server):
    r = _post(server, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2}, headers=headers)
    assert r.status_code == 401 and "missing or wrong API key" in r.json()["error"]["message"]
    assert httpx.get(f"{server.url}/v1/models", headers=headers).status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200  # health and metrics stay open
    assert _post(server, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2}).status_code == 200


def test_chat_without_a_template_is_a_clear_400(server):  # H28
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == ("model 'tiny-llama' has no chat template (its tokenizer defines "
                                            "none); start the server with --chat-template FILE, or use /v1/completions")


def _first_event(lines) -> None:
    # NOTE: leaving a `for` over iter_lines() closes the connection, which aborts the request
    while not next(lines).startswith("data: "):
        pass


def test_queue_full_is_503_with_retry_after(server):  # H29
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as a, httpx.Client(
            base_url=server.url, headers=AUTH, timeout=30) as b:
        with a.stream("POST", "/v1/completions", json=LONG) as running:
            lines = running.iter_lines()  # kept: a collected iterator closes the connection
            _first_event(lines)  # it holds the only request row
            with b.stream("POST", "/v1/completions", json=LONG) as waiting:
                assert waiting.status_code == 200  # accepted: it waits for the row
                assert server.wait_metric("backplane_num_requests_waiting", 1.0) == 1.0
                r = _post(server, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})
                assert r.status_code == 503 and r.headers["Retry-After"] == "1"
                assert "the limit is 1 (--max-queued-requests)" in r.json()["error"]["message"]
    assert server.wait_metric("backplane_kv_cache_used_tokens", 0.0) == 0.0
    assert server.wait_metric("backplane_num_requests_waiting", 0.0) == 0.0


def test_sigterm_with_a_stream_in_flight_exits_cleanly(server):  # H30; must run last in this module
    events: list[str] = []

    def consume():
        try:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=LONG, headers=AUTH, timeout=30) as r:
                events.extend(line for line in r.iter_lines() if line)
        except httpx.HTTPError as err:
            events.append(f"closed: {type(err).__name__}")

    reader = threading.Thread(target=consume)
    reader.start()
    while not events and reader.is_alive():
        time.sleep(0.01)
    start = time.monotonic()
    assert server.terminate(timeout=20) == 0, server.output()
    reader.join(10)
    assert not reader.is_alive() and time.monotonic() - start < 15
    assert len(events) < 1900  # it was cut after --shutdown-timeout, not run to the end
    assert events[-2:] == ['data: {"error":{"message":"the server is shutting down","type":"service_unavailable",'
                           '"param":null,"code":503}}', "data: [DONE]"]
    assert "Traceback" not in server.output()


def test_serve_without_the_extra_says_how_to_install():
    code = ("import sys; sys.modules.update(fastapi=None, uvicorn=None, prometheus_client=None)\n"
            "import backplane\nfrom backplane.cli import main\nmain(['--help'])\n")
    help_run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert help_run.returncode == 0 and "an OpenAI-compatible HTTP server" in help_run.stdout, help_run.stderr
    serve = subprocess.run([sys.executable, "-c", "import sys; sys.modules.update(fastapi=None)\n"
                            "from backplane.cli import main; sys.exit(main(['serve', '--model', 'tiny-llama']))"],
                           capture_output=True, text=True)
    assert serve.returncode == 2
    assert serve.stderr.strip() == ("backplane: error: backplane serve needs fastapi, not installed here; "
                                    "install the serve extra: pip install 'backplane-llm[serve]'")


def test_api_key_flag_and_env(monkeypatch):
    from backplane.cli.main import build_parser
    from backplane.cli.serve import serve_args_from
    from backplane.plugin.manager import load_plugins

    parser = build_parser(load_plugins())
    assert serve_args_from(parser.parse_args(["serve", "--api-key", "k1"])).api_key == "k1"
    monkeypatch.setenv("BACKPLANE_API_KEY", "k2")
    assert serve_args_from(parser.parse_args(["serve"])).api_key == "k2"
    assert serve_args_from(parser.parse_args(["serve", "--api-key", "k1"])).api_key == "k1"
