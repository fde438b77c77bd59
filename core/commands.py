"""The `generate` and `bench` subcommands (filled in by the engine and graph-runner work)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace


def _not_built(name: str):
    def run(ns, args, plugin_set) -> int:
        raise SystemExit(f"backplane {name}: not built yet")

    return run


generate_command = SimpleNamespace(add_arguments=lambda p: None, run=_not_built("generate"))
bench_command = SimpleNamespace(add_arguments=lambda p: None, run=_not_built("bench"))
