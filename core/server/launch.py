"""run_server: build the engine, then serve the app with uvicorn until SIGINT/SIGTERM.

On SIGTERM new generation requests get 503, requests in flight may finish for
--shutdown-timeout seconds, then uvicorn cancels them (which aborts them in the engine), and the
engine thread stops: the process exits with nothing left running. Import this module only after
`check_serve_dependencies()`.
"""

from __future__ import annotations

from typing import Any

import uvicorn

from backplane.engine import AsyncEngine, Engine
from backplane.server.app import build_app


class DrainingServer(uvicorn.Server):
    """uvicorn.Server that marks the app as draining as soon as a shutdown signal arrives."""

    def __init__(self, config: uvicorn.Config, state: Any):
        super().__init__(config)
        self.app_state = state

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.app_state.draining = True
        super().handle_exit(sig, frame)


def run_server(server_args: Any, serve_args: Any, plugin_set: Any) -> int:
    engine = AsyncEngine(engine=Engine(server_args=server_args, plugin_set=plugin_set),
                         max_queued_requests=serve_args.max_queued_requests)
    try:
        app = build_app(engine, serve_args)
    except ValueError:  # a bad --chat-template
        engine.shutdown()
        raise
    config = uvicorn.Config(app, host=serve_args.host, port=serve_args.port, log_level=server_args.log_level,
                            timeout_graceful_shutdown=serve_args.shutdown_timeout, access_log=False)
    state = app.state.server
    print(f"backplane serve: model {state.model_name} on http://{serve_args.host}:{serve_args.port} "
          "(OpenAI API under /v1)", flush=True)
    DrainingServer(config, state).run()
    engine.shutdown()
    return 0
