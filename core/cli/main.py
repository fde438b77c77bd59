"""The `backplane` command: `plugins`, `generate`, `bench` and `serve`, all built from EngineArgs."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Callable

from backplane.cli.args import add_model_flags, prescan_strict, split_namespace
from backplane.plugin.manager import PluginLoadError, PluginSet, load_plugins
from backplane.plugin.runtime import PluginRuntimeError
from backplane.settings import EngineArgs, SettingsError, build_server_args

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a command stopped by Ctrl-C


class UsageError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        plugin_set = load_plugins(strict=prescan_strict(argv))
        parser = build_parser(plugin_set)
        ns = parser.parse_args(argv)
        if not getattr(ns, "command", None):
            parser.print_help()
            return EXIT_USAGE
        return ns.handler(ns, plugin_set)
    # FileNotFoundError: a model directory without config.json or weights (messages name the path).
    # PluginRuntimeError: a plugin's factory, hook or op failed after loading (the line names it).
    except (SettingsError, UsageError, PluginLoadError, PluginRuntimeError, ValueError, FileNotFoundError) as err:
        print(f"backplane: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # the command's engine (and its tensor-parallel workers) is already stopped
        print("backplane: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump), raised to `main` for exit code 2."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message}")


def build_parser(plugin_set: PluginSet) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="backplane", description="An LLM model executor whose every backend is a plugin."
    )
    sub = parser.add_subparsers(dest="command", metavar="{plugins,generate,bench,serve}")
    plugins = sub.add_parser("plugins", help="list plugins, what they registered and what is usable here")
    plugins.add_argument("--json", action="store_true", help="print one JSON document")
    plugins.add_argument("--strict-plugins", action="store_true", help="a plugin that fails to load is fatal")
    plugins.set_defaults(handler=_cmd_plugins)
    from backplane.cli.commands import bench_command, generate_command
    from backplane.cli.serve import serve_command

    for name, help_text, command in (
        ("generate", "generate text or token ids with a model or preset", generate_command),
        ("bench", "one-batch prefill/decode latency, eager vs CUDA graph", bench_command),
        ("serve", "an OpenAI-compatible HTTP server (needs the serve extra)", serve_command),
    ):
        p = sub.add_parser(name, help=help_text)
        command.add_arguments(p)
        _add_settings_flags(p, plugin_set)
        p.set_defaults(handler=_settings_handler(command.run))
    return parser


def _add_settings_flags(parser: argparse.ArgumentParser, plugin_set: PluginSet) -> None:
    from backplane.speculative.factory import algorithm_help

    add_model_flags(parser, EngineArgs)
    for action in parser._actions:  # the algorithms installed here, not a fixed list
        if action.dest == "speculative_algorithm":
            action.help = algorithm_help(plugin_set.registry)
    for group, model in sorted(plugin_set.settings_groups().items()):
        add_model_flags(parser, model, group=group)


def parse_server_args(argv: list[str], plugin_set: PluginSet) -> EngineArgs:
    """Parse EngineArgs (and plugin groups) from flags as `backplane generate` would."""
    ns = build_parser(plugin_set).parse_args(["generate", *argv])
    core, grouped = split_namespace(ns, plugin_set.settings_groups())
    return build_server_args(core, plugin_set.settings_groups(), grouped)


def _settings_handler(run: Callable[[argparse.Namespace, EngineArgs, PluginSet], int]):
    def handler(ns: argparse.Namespace, plugin_set: PluginSet) -> int:
        core, grouped = split_namespace(ns, plugin_set.settings_groups())
        args = build_server_args(core, plugin_set.settings_groups(), grouped)
        try:
            plugin_set.configure(args)
        except ValueError as err:
            raise UsageError(str(err)) from None
        logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
        return run(ns, args, plugin_set)

    return handler


def _cmd_plugins(ns: argparse.Namespace, plugin_set: PluginSet) -> int:
    from backplane.plugin.listing import describe_plugins, format_plugins

    report = describe_plugins(plugin_set)
    print(json.dumps(report, indent=2) if ns.json else format_plugins(report))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
