"""Deprecated alias of `backplane.text.stream` (the engine split by concern; until 0.3)."""

from backplane.deprecation import moved_names

__getattr__ = moved_names(__name__, "backplane.text.stream", ["Delta", "RequestStream", "StreamChunk", "deliver_by_loop", "stop_holdback"])
