"""Streamed text equals the final text (backplane.text.detokenize), with a SentencePiece-style
tokenizer whose decoder drops the space before a first word (issue 42, bug 4)."""

from __future__ import annotations

import pytest

from backplane.text.detokenize import IncrementalText

VOCAB = {"<unk>": 0, "<sp>": 1, "▁hello": 2, "▁world": 3, "▁the": 4, "▁end": 5}


@pytest.fixture(scope="module")
def metaspace():
    """A word-level tokenizer with Metaspace pre-tokenizer and decoder and one special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", additional_special_tokens=["<sp>"])
    return lambda ids: fast.decode(ids, skip_special_tokens=True)


def stream(decode, ids, steps):
    """The text IncrementalText releases when `ids` arrive `steps[i]` tokens at a time."""
    inc, pieces, n = IncrementalText(decode), [], 0
    for k in steps:
        n += k
        pieces.append(inc.update(ids[:n], finished=n == len(ids)))
    return "".join(pieces)


@pytest.mark.parametrize("ids", [[2, 1, 3, 4], [2, 1, 1, 1, 3, 4], [1, 2, 1, 3], [2, 3, 1, 4, 1, 5]])
def test_a_skipped_special_token_keeps_the_next_words_space(metaspace, ids):
    assert metaspace([1, 3]) == "world"  # the hazard: a window starting at the special token
    assert stream(metaspace, ids, [1] * len(ids)) == metaspace(ids)


def test_the_stream_equals_the_final_text_in_any_steps(metaspace):
    ids = [2, 1, 3, 1, 4, 5, 1, 2]
    for steps in ([2, 3, 3], [1, 2, 1, 4], [3, 1, 1, 1, 1, 1]):
        assert stream(metaspace, ids, steps) == metaspace(ids) == "hello world the end hello"
