"""Tokenizer glue: the model directory's Hugging Face tokenizer, or the byte-level one for presets."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# What holds a vocabulary (tokenizer_config.json alone does not: transformers then builds an empty one).
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                    "sentencepiece.bpe.model")


def load_tokenizer(path: Path | None, vocab_size: int, tokenizer_path: str | None = None) -> Any | None:
    """A tokenizer with encode/decode/eos_token_id, or None when the model has none (ids only).

    tokenizer_path (--tokenizer-path) is used instead of the model directory when given; it must
    hold a tokenizer. A tokenizer that transformers cannot load is a one-line ValueError naming it.
    """
    if tokenizer_path is not None:
        path = Path(tokenizer_path).expanduser()
        if not _has_tokenizer(path):
            raise ValueError(f"--tokenizer-path {tokenizer_path!r}: expected a directory holding one of "
                             f"{', '.join(TOKENIZER_FILES)}, found none")
    if path is not None and _has_tokenizer(path):
        return _hf_tokenizer(path, "--tokenizer-path" if tokenizer_path is not None else "model tokenizer")
    from backplane.models.byte_tokenizer import ByteTokenizer

    if path is not None and path.is_dir():  # a real model directory without one: say what text will be
        logger.warning("model directory '%s' has no tokenizer (%s): text is encoded as bytes, not the model's "
                       "vocabulary; pass --tokenizer-path DIR", path, ", ".join(TOKENIZER_FILES))

    if vocab_size >= ByteTokenizer.vocab_size:
        return ByteTokenizer()
    logger.warning("model has no tokenizer and a vocabulary too small for bytes: token ids only")
    return None


def decode_text(tokenizer: Any | None, ids: list[int]) -> str:
    """The text of `ids` as the engine reports it (special tokens skipped; "" without a tokenizer)."""
    return tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else ""


def _has_tokenizer(path: Path) -> bool:
    return path.is_dir() and any((path / name).exists() for name in TOKENIZER_FILES)


def _hf_tokenizer(path: Path, what: str) -> Any:
    from transformers import AutoTokenizer

    if not any((path / name).exists() for name in VOCABULARY_FILES):
        raise ValueError(f"{what} '{path}': tokenizer_config.json without a vocabulary; expected one of "
                         f"{', '.join(VOCABULARY_FILES)} beside it (or --tokenizer-path DIR)")

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # noqa: BLE001 - corrupt JSON, a missing vocabulary file, ...: one line naming it
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ValueError(f"{what} '{path}': expected a tokenizer transformers can load "
                         f"({', '.join(TOKENIZER_FILES)}), got {type(exc).__name__}: {first}") from None


def eos_ids(tokenizer: Any | None, hf_config: Any) -> set[int]:
    ids = set()
    for source in (getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(source)
    return ids
