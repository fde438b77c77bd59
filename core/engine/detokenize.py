"""Deprecated alias of `backplane.text.detokenize` (the engine split by concern; until 0.3)."""

from backplane.deprecation import moved_names

__getattr__ = moved_names(__name__, "backplane.text.detokenize", ['IncrementalText', 'REPLACEMENT', 'MAX_WAITING_TOKENS'])
