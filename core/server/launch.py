"""run_server: build the engine, then serve the app with uvicorn until SIGINT/SIGTERM.

The engine runs in a process of its own (ProcessEngine), or with --engine-in-thread in a thread
of this one (AsyncEngine); either way the port opens only once the engine is ready. On SIGTERM
(or Ctrl-C) new generation requests get 503 and requests in flight may finish for
--shutdown-timeout seconds; then the engine aborts them (their streams end with an error event
and `data: [DONE]`, whole requests get 503), uvicorn closes the connections, and the engine
stops: the process exits 0 with nothing left running, within --shutdown-timeout + 0.5 s. The
shutdown and each of its steps are logged. Import this module only after `check_serve_dependencies()`.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any

import uvicorn

from backplane.engine import AsyncEngine, Engine
from backplane.engine.engine_process import freeze_startup_heap
from backplane.engine.process_engine import ProcessEngine
from backplane.server.app import build_app, stop_engine
from backplane.server.generation import SHUTDOWN_MESSAGE

logger = logging.getLogger(__name__)
# After the abort at --shutdown-timeout, streams end at once; uvicorn's own limit is a backstop only.
GRACE_S = 0.3


class DrainingServer(uvicorn.Server):
    """uvicorn.Server that marks the app as draining as soon as a shutdown signal arrives."""

    def __init__(self, config: uvicorn.Config, state: Any, drain_s: float):
        super().__init__(config)
        self.app_state = state
        self.drain_s = drain_s

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.app_state.draining:
            self.app_state.draining = True
            self.drain_started = time.monotonic()
            engine = self.app_state.engine
            running = engine.num_running + engine.num_waiting
            logger.warning("shutting down (signal %d): %d requests in flight may finish within %.1f s "
                           "(--shutdown-timeout); new requests get 503", sig, running, self.drain_s)
            timer = threading.Timer(self.drain_s, self._abort_rest)
            timer.daemon = True
            timer.start()
        super().handle_exit(sig, frame)
        # NOTE: uvicorn re-raises a captured signal after its graceful shutdown, so the process
        # would die by SIGTERM with no exit code of ours; a drained shutdown is a clean exit (0).
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()


    def _abort_rest(self) -> None:
        logger.warning("shutdown: --shutdown-timeout %.1f s reached, aborting the requests still running",
                       self.drain_s)
        self.app_state.engine.abort_all(SHUTDOWN_MESSAGE)


def start_engine(server_args: Any, serve_args: Any, plugin_set: Any) -> Any:
    """The engine in its own process (plugins load again there), or in a thread with --engine-in-thread."""
    if serve_args.engine_in_thread:
        return AsyncEngine(engine=Engine(server_args=server_args, plugin_set=plugin_set),
                           max_queued_requests=serve_args.max_queued_requests)
    return ProcessEngine(server_args, max_queued_requests=serve_args.max_queued_requests)


def run_server(server_args: Any, serve_args: Any, plugin_set: Any) -> None:
    """Serve until SIGTERM/SIGINT; the process then exits 0 (this function does not return)."""
    engine = start_engine(server_args, serve_args, plugin_set)
    try:
        app = build_app(engine, serve_args)
    except BaseException:  # a bad --chat-template
        engine.shutdown()
        raise
    # uvicorn's own limit is a backstop only: the engine aborts what is left after shutdown_timeout.
    config = uvicorn.Config(app, host=serve_args.host, port=serve_args.port, log_level=server_args.log_level,
                            timeout_graceful_shutdown=serve_args.shutdown_timeout + GRACE_S, access_log=False)
    if serve_args.access_log:
        logging.getLogger("backplane.server.access").setLevel(logging.INFO)
    freeze_startup_heap()  # this process serves until it exits: its startup objects need no scanning
    state = app.state.server
    print(f"backplane serve: model {state.model_name} on http://{serve_args.host}:{serve_args.port} "
          "(OpenAI API under /v1)", flush=True)
    try:
        DrainingServer(config, state, serve_args.shutdown_timeout).run()
    finally:
        stop_engine(engine)
    logger.warning("backplane serve: stopped")
    exit_now(0)


def exit_now(code: int) -> None:
    """End the process at once, its output flushed: everything it started has stopped, and the
    interpreter's teardown of torch and the tokenizer (up to seconds) would stretch the bound that
    --shutdown-timeout promises."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
