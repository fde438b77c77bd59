"""A live `backplane serve` for tests and benchmarks: `LiveServer`.

What it starts: `python -m backplane.cli serve --port PORT ARGS...` in a subprocess of this
interpreter, on a port of 127.0.0.1 that was free a moment before (`free_port`), with this
process's environment plus `env`. The server's stdout and stderr go to one log file: `log_path`,
which is kept, or a temporary file, which `stop()` deletes.

How it waits: the constructor polls GET /health (without proxies) every `poll_s` seconds and returns
once it answers 200. If the process exits first, or /health has not answered 200 within
`startup_timeout` seconds, it stops the process and raises `ServerStartError`: the exit code (or
the timeout), the kept log's path, and the log's last 30 lines.

How it stops: `terminate()` sends SIGTERM (the server drains and exits 0) and waits, raising
`subprocess.TimeoutExpired` on a hang, so a test of shutdown fails; `stop()` does the same but kills
a server that hangs, then closes the log (deleting a temporary one). Both return the exit code.
`with LiveServer(...) as server:` stops it on leaving.

Needs the serve extra and httpx (`missing_dependencies()` names what is not importable).

    with LiveServer("--model", "tiny-llama", "--device", "cpu") as server:
        httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 4})
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from backplane.distributed.launcher import free_port
from backplane.server import SERVE_DEPENDENCIES

__all__ = ["LiveServer", "ServerStartError", "missing_dependencies"]

CLIENT_DEPENDENCIES = {"httpx": "httpx"}  # import name -> distribution


class ServerStartError(RuntimeError):
    """`backplane serve` exited or was not ready in time; the message ends with its last log lines."""


def missing_dependencies() -> list[str]:
    """The distributions a LiveServer needs (the serve extra and httpx) that are not importable here."""
    needed = {**SERVE_DEPENDENCIES, **CLIENT_DEPENDENCIES}
    return [dist for module, dist in needed.items() if importlib.util.find_spec(module) is None]


class LiveServer:
    """`backplane serve ARGS...` in a subprocess, ready when the constructor returns; `url` is its base
    address (`http://127.0.0.1:PORT`), `proc` its `subprocess.Popen`, `log_path` its log file."""

    def __init__(self, *args: str, log_path: str | Path | None = None, startup_timeout: float = 120.0,
                 env: dict[str, str] | None = None, poll_s: float = 0.1):
        if not startup_timeout > 0:
            raise ValueError(f"startup_timeout: expected a positive number of seconds, got {startup_timeout!r}")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._owns_log = log_path is None
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="backplane-serve-", suffix=".log")
            self.log_path, self._log = Path(name), os.fdopen(fd, "w")
        else:
            self.log_path = Path(log_path)
            self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "backplane.cli", "serve", "--port", str(self.port), *args],
                                     stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        self._wait_ready(startup_timeout, poll_s)

    def __enter__(self) -> LiveServer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _wait_ready(self, timeout: float, poll_s: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._fail(f"backplane serve exited with code {self.proc.returncode} before /health answered")
            if self._healthy():
                return
            time.sleep(poll_s)
        self._fail(f"backplane serve: /health did not answer 200 within the startup timeout of {timeout:g} s")

    def _fail(self, reason: str) -> None:
        tail, where = self.tail(), "" if self._owns_log else f" ({self.log_path})"
        self.stop()
        raise ServerStartError(f"{reason}; the last lines of its log{where}:\n{tail}")

    def _healthy(self) -> bool:
        import httpx

        try:
            return httpx.get(f"{self.url}/health", timeout=2.0, trust_env=False).status_code == 200
        except httpx.TransportError:
            return False

    def output(self) -> str:
        """The whole log so far."""
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = 30) -> str:
        """The last `lines` lines of the log."""
        return "\n".join(self.output().splitlines()[-lines:])

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM (nothing if it has exited), then wait; the exit code. A hang raises TimeoutExpired."""
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.proc.wait(timeout=timeout)

    def stop(self, timeout: float = 60.0) -> int:
        """`terminate`, killing the server if it has not exited within `timeout` s; then close the log
        (and delete it if it is a temporary one). The exit code; negative: the signal that ended it."""
        try:
            code = self.terminate(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._log.close()
        if self._owns_log:
            self.log_path.unlink(missing_ok=True)
        return code

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, as `name` or `name{labels}` -> value."""
        import httpx

        text = httpx.get(f"{self.url}/metrics", timeout=5.0, trust_env=False).text
        samples = (line.rpartition(" ") for line in text.splitlines() if line and not line.startswith("#"))
        return {name: float(value) for name, _, value in samples}

    def wait_metric(self, name: str, value: float, timeout: float = 5.0) -> float | None:
        """Poll /metrics until `name` equals `value` or `timeout` s pass; the last value seen (None: absent)."""
        deadline = time.monotonic() + timeout
        seen = self.metrics().get(name)
        while seen != value and time.monotonic() < deadline:
            time.sleep(0.02)
            seen = self.metrics().get(name)
        return seen
