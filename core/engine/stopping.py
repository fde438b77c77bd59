"""Deprecated alias of `backplane.scheduler.stopping` (the engine split by concern; until 0.3)."""

from backplane.deprecation import moved_names

__getattr__ = moved_names(__name__, "backplane.scheduler.stopping", ['check_stop'])
