"""Deprecated alias of `backplane.scheduler.prefix_cache` (the engine split by concern; until 0.3)."""

from backplane.deprecation import moved_names

__getattr__ = moved_names(__name__, "backplane.scheduler.prefix_cache", ["IN_BATCH_SHARE_MIN", "LPM_MAX_WAITING", "PrefixCache", "PrefixCacheStats", "prefill_target"])
