"""`backplane serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) on AsyncEngine.

Needs the `serve` extra (`pip install "backplane-llm[serve]"`: fastapi, uvicorn,
prometheus-client); they are imported only when the server is built, so `import backplane`
works without them. `backplane.server.app.build_app(engine, serve_args)` makes the ASGI app;
`backplane.server.launch.run_server` serves it.
"""

import importlib.util

from backplane.server.settings import ServeArgs

__all__ = ["ServeArgs", "check_serve_dependencies"]

SERVE_DEPENDENCIES = {"fastapi": "fastapi", "uvicorn": "uvicorn", "prometheus_client": "prometheus-client"}


def check_serve_dependencies() -> None:
    """Raise ValueError saying how to install the serve extra when a dependency is missing."""
    missing = [dist for module, dist in SERVE_DEPENDENCIES.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise ValueError(f"backplane serve needs {', '.join(missing)}, not installed here; "
                         "install the serve extra: pip install 'backplane-llm[serve]'")
