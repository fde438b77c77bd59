"""The `serve` subcommand: EngineArgs (model, backends, plugin groups) plus ServeArgs (host, port, ...)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

from pydantic import ValidationError

from backplane.cli.args import add_model_flags
from backplane.server.settings import ServeArgs
from backplane.settings import SettingsError, format_validation_error


def _add_serve_arguments(p: argparse.ArgumentParser) -> None:
    add_model_flags(p, ServeArgs, title="HTTP server")


def serve_args_from(ns: argparse.Namespace) -> ServeArgs:
    values = {name: getattr(ns, name) for name in ServeArgs.model_fields if hasattr(ns, name)}
    try:
        return ServeArgs(**values)
    except ValidationError as err:
        raise SettingsError(format_validation_error(err)) from None


def _run_serve(ns: argparse.Namespace, args, plugin_set) -> int:
    from backplane.server import check_serve_dependencies

    serve_args = serve_args_from(ns)
    check_serve_dependencies()  # before the model loads
    from backplane.server.launch import run_server

    return run_server(args, serve_args, plugin_set)


serve_command = SimpleNamespace(add_arguments=_add_serve_arguments, run=_run_serve)
