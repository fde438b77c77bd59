"""A model directory's tokenizer files: tokenizer_config.json without a vocabulary is refused in one
line (transformers would build an empty tokenizer that encodes every prompt to nothing); a
directory with no tokenizer at all serves bytes and says so in a warning."""

from __future__ import annotations

import json
import logging

import pytest

from backplane.text.tokenizer import load_tokenizer


def test_tokenizer_config_without_a_vocabulary_is_one_line(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    with pytest.raises(ValueError) as info:
        load_tokenizer(tmp_path, vocab_size=300)
    message = str(info.value)
    assert message.startswith(f"model tokenizer '{tmp_path}': tokenizer_config.json without a vocabulary; "
                              "expected one of tokenizer.json, tokenizer.model")
    assert "\n" not in message


def test_a_directory_without_a_tokenizer_warns_and_serves_bytes(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="backplane.text.tokenizer"):
        tokenizer = load_tokenizer(tmp_path, vocab_size=300)
    assert type(tokenizer).__name__ == "ByteTokenizer" and tokenizer.decode(tokenizer.encode("hi")) == "hi"
    assert any("has no tokenizer" in r.message and "--tokenizer-path" in r.message for r in caplog.records)


def test_a_preset_serves_bytes_without_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="backplane.text.tokenizer"):
        assert load_tokenizer(None, vocab_size=300) is not None
    assert not caplog.records
