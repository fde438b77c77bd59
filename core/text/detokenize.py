"""IncrementalText: the text of a growing list of token ids, released in pieces that never change.

Decoding the whole output after every step costs O(length) per step, and a piece cut in the
middle of a multi-byte character or a stop string would have to be taken back. This decodes
only a short window of recent tokens (the offsets trick of Hugging Face's TextStreamer), waits
while the window ends in an incomplete character, and holds back the last `holdback` characters
(the longest stop string minus one) until the request finishes, so everything released is a
prefix of the final text.

The window moves on after every step that adds text, so each update decodes a few tokens, never
the whole output. Tokens that decode to no text at all (a skipped special token, an id outside a
byte tokenizer's range) are left out of the window instead of starting it: a window that started
at such a token would decode the next word as the first of a text, and SentencePiece-style
(Metaspace) decoders drop the space before a first word ('hello<special> world' would stream as
'helloworld' while the final text is 'hello world'). Only an incomplete character or text that
changed under the new tokens keeps the text waiting, and at most MAX_WAITING_TOKENS tokens: past
that the window is released as it decodes (only invalid UTF-8 gets there, and its U+FFFD stays).
"""

from __future__ import annotations

from typing import Callable

REPLACEMENT = "\ufffd"  # what decoding gives for an incomplete UTF-8 sequence
MAX_WAITING_TOKENS = 16  # a UTF-8 character has at most 4 bytes; this is well past any real wait


class IncrementalText:
    def __init__(self, decode: Callable[[list[int]], str], holdback: int = 0):
        self.decode = decode
        self.holdback = holdback
        self.window: list[int] = []  # the last ids that added text (already in `pending` or released)
        self.read = 0  # ids[:read] are decoded
        self.pending = ""  # decoded but held back
        self.released = 0  # characters handed out so far

    def update(self, ids: list[int], finished: bool = False, final_text: str | None = None) -> str:
        """The new text after `ids` (the whole output so far); on the last call pass finished=True.

        final_text: the request's text when the engine cut it at a stop string; the remainder of
        it is released and nothing after it.
        """
        if final_text is not None:
            delta = final_text[self.released:]
            self.released = len(final_text)
            return delta
        self.pending += self._new_text(ids, finished)
        keep = 0 if finished else self.holdback
        out = self.pending[: max(len(self.pending) - keep, 0)]
        self.pending = self.pending[len(out):]
        self.released += len(out)
        return out

    def _new_text(self, ids: list[int], finished: bool) -> str:
        if len(ids) == self.read:
            return ""
        new = ids[self.read:]
        before = self.decode(self.window)
        after = self.decode(self.window + new)
        if not finished and self._must_wait(before, after, len(ids)):
            return ""
        if after != before:
            self.window = new  # NOTE: text-less tokens never start a window: the window keeps its text
        self.read = len(ids)
        return after[len(before):]

    def _must_wait(self, before: str, after: str, num_ids: int) -> bool:
        """A character whose bytes are still coming, or text the new tokens changed, within the cap."""
        if num_ids - self.read > MAX_WAITING_TOKENS:
            return False
        changed = len(after) <= len(before) and after != before
        return changed or after.endswith(REPLACEMENT)
