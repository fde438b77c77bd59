"""Deprecated alias of `backplane.scheduler.sampling_state` (the engine split by concern; until 0.3)."""

from backplane.deprecation import moved_names

__getattr__ = moved_names(__name__, "backplane.scheduler.sampling_state", ['SamplingCache', 'sampling_batch'])
