"""Live `backplane serve` processes for the server tests: a free port, /health polled until ready,
SIGTERM at the end (the exit code is checked by the caller), and /metrics read as numbers."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

CHAT_TEMPLATE = Path(__file__).parent / "server" / "chat_template.jinja"
TINY = ["--model", "tiny-llama", "--device", "cpu", "--attention-backend", "torch_native",
        "--max-total-tokens", "16384"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """`python -m backplane.cli.main serve ...` in a subprocess; `url` is its base address."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, startup_timeout: float = 120.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="backplane-serve-", suffix=".log", delete=False)
        child_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "backplane.cli", "serve", "--port", str(self.port), *args],
            stdout=self.log, stderr=subprocess.STDOUT, env=child_env)
        self._wait_ready(startup_timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.output()}")

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM, then wait; the exit code (a hang fails the caller's test with TimeoutExpired)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        try:
            self.terminate()
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        Path(self.log.name).unlink(missing_ok=True)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics without labels or with them, as `name{labels}` -> value."""
        text = httpx.get(f"{self.url}/metrics", timeout=5.0).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def wait_metric(self, name: str, value: float, timeout: float = 5.0) -> float:
        """Poll /metrics until `name` equals `value`; return the last value seen."""
        deadline = time.monotonic() + timeout
        seen = self.metrics().get(name)
        while seen != value and time.monotonic() < deadline:
            time.sleep(0.02)
            seen = self.metrics().get(name)
        return seen
