"""The `backplane` command: `plugins`, `generate`, `bench`, `serve`, built from the same settings model."""

from backplane.cli.main import main, parse_server_args

__all__ = ["main", "parse_server_args"]
