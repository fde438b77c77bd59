"""Deprecated alias of `backplane.scheduler.overlap` (the engine split by concern; until 0.3)."""

from backplane.deprecation import moved_names

__getattr__ = moved_names(__name__, "backplane.scheduler.overlap", ['FutureTokens', 'LaunchedStep'])
