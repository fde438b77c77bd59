"""Tokenizer glue: the model directory's Hugging Face tokenizer, or the byte-level one for presets."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(path: Path | None, vocab_size: int) -> Any | None:
    """A tokenizer with encode/decode/eos_token_id, or None when the model has none (ids only)."""
    if path is not None and any((path / name).exists() for name in TOKENIZER_FILES):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))
    from backplane.models.byte_tokenizer import ByteTokenizer

    if vocab_size >= ByteTokenizer.vocab_size:
        return ByteTokenizer()
    logger.warning("model has no tokenizer and a vocabulary too small for bytes: token ids only")
    return None


def eos_ids(tokenizer: Any | None, hf_config: Any) -> set[int]:
    ids = set()
    for source in (getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(source)
    return ids
