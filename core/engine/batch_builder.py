"""Deprecated alias of `backplane.scheduler.batch_builder` (the engine split by concern; until 0.3)."""

from backplane.deprecation import moved_names

__getattr__ = moved_names(__name__, "backplane.scheduler.batch_builder", ["build_decode_batch", "build_extend_batch"])
