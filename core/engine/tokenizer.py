"""Deprecated alias of `backplane.text.tokenizer` (the engine split by concern; until 0.3)."""

from backplane.deprecation import moved_names

__getattr__ = moved_names(__name__, "backplane.text.tokenizer", ['load_tokenizer', 'decode_text', 'eos_ids', 'TOKENIZER_FILES'])
