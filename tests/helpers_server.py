"""Live `backplane serve` processes for the server tests: `backplane.testing.server.LiveServer` with
one CPU thread (tiny models run fastest on one) and a temporary log; the exit code of `terminate()`
is checked by the caller. `TINY` is the tiny model's flags, `CHAT_TEMPLATE` a template for chat."""

from __future__ import annotations

from pathlib import Path

from backplane.distributed.launcher import free_port
from backplane.testing import server

__all__ = ["CHAT_TEMPLATE", "TINY", "LiveServer", "free_port"]

CHAT_TEMPLATE = Path(__file__).parent / "server" / "chat_template.jinja"
TINY = ["--model", "tiny-llama", "--device", "cpu", "--attention-backend", "torch_native",
        "--max-total-tokens", "16384"]


class LiveServer(server.LiveServer):
    """The package's LiveServer with OMP_NUM_THREADS=1 unless `env` sets it."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, startup_timeout: float = 120.0):
        super().__init__(*args, env={"OMP_NUM_THREADS": "1", **(env or {})}, startup_timeout=startup_timeout)
