"""The `backplane` command: `plugins`, `generate`, `bench`, built from the same settings model."""

from backplane.cli.main import main, parse_server_args

__all__ = ["main", "parse_server_args"]
