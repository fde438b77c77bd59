"""The `serve` subcommand: EngineArgs (model, backends, plugin groups) plus ServeArgs (host, port, ...).

What can be checked without the model is checked first, each a one-line error with exit code 2:
the flags, the serve extra, that --host and --port can be listened on, then the model's config
(`preflight`). With the engine in a process of its own, that process takes the CPU threads and
this (HTTP) process keeps one.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from types import SimpleNamespace

from pydantic import ValidationError

from backplane.cli.args import add_model_flags, preflight
from backplane.server.settings import ServeArgs
from backplane.settings import SettingsError, format_validation_error

logger = logging.getLogger(__name__)


def _add_serve_arguments(p: argparse.ArgumentParser) -> None:
    add_model_flags(p, ServeArgs, title="HTTP server")


def serve_args_from(ns: argparse.Namespace) -> ServeArgs:
    values = {name: getattr(ns, name) for name in ServeArgs.model_fields if hasattr(ns, name)}
    try:
        return ServeArgs(**values)
    except ValidationError as err:
        raise SettingsError(format_validation_error(err)) from None


def check_listen_address(host: str, port: int) -> None:
    """Bind (and release) host:port now, so a bad --host or a busy --port fails before the model loads."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
    except OSError as err:  # socket.gaierror included: an address that does not resolve
        raise ValueError(f"--host {host} --port {port}: cannot listen there: {err.strerror or err}; "
                         "expected a local address (127.0.0.1, 0.0.0.0, ::) and a free port") from None


def split_threads(args, serve_args: ServeArgs) -> None:
    """With the engine in its own process, it gets this process's thread count (through
    OMP_NUM_THREADS, which its torch reads at start) and the HTTP side keeps one thread."""
    import torch

    if serve_args.engine_in_thread or args.device == "cuda":
        return
    os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    torch.set_num_threads(1)


def _run_serve(ns: argparse.Namespace, args, plugin_set) -> int:
    from backplane.server import check_serve_dependencies

    serve_args = serve_args_from(ns)
    if os.environ.get("BACKPLANE_API_KEY") == "" and serve_args.api_key is None:
        print("backplane serve: BACKPLANE_API_KEY is empty, so it is unset: serving without authentication",
              file=sys.stderr)
    check_serve_dependencies()  # before the model loads
    check_listen_address(serve_args.host, serve_args.port)
    logger.info("backplane serve: %s", preflight(args))  # stderr stays one line when startup fails
    split_threads(args, serve_args)
    from backplane.server.launch import run_server

    run_server(args, serve_args, plugin_set)  # serves until SIGTERM, then ends the process
    return 0


serve_command = SimpleNamespace(add_arguments=_add_serve_arguments, run=_run_serve)
