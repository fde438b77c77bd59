"""A byte-level tokenizer for the dummy presets: no download, every string round-trips.

ids: 0 = pad, 1 = bos, 2 = eos, 3..258 = the UTF-8 bytes 0..255. Ids above 258 (a dummy model's
vocabulary is larger) decode to nothing.
"""

from __future__ import annotations

from typing import Iterable

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
BYTE_OFFSET = 3
_SPECIAL_TEXT = {PAD_ID: "<pad>", BOS_ID: "<s>", EOS_ID: "</s>"}


class ByteTokenizer:
    """The subset of a Hugging Face tokenizer that the engine uses."""

    pad_token_id = PAD_ID
    bos_token_id = BOS_ID
    eos_token_id = EOS_ID
    vocab_size = BYTE_OFFSET + 256

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """UTF-8 bytes of `text` shifted by 3, after a bos id when add_special_tokens (like Llama's)."""
        ids = [b + BYTE_OFFSET for b in text.encode("utf-8")]
        return [BOS_ID, *ids] if add_special_tokens else ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of the byte ids (invalid UTF-8 becomes U+FFFD); specials shown unless skipped."""
        out, pending = [], bytearray()
        for i in (int(x) for x in ids):
            if BYTE_OFFSET <= i < self.vocab_size:
                pending.append(i - BYTE_OFFSET)
                continue
            if not skip_special_tokens and i in _SPECIAL_TEXT:
                out.append(pending.decode("utf-8", errors="replace"))
                out.append(_SPECIAL_TEXT[i])
                pending = bytearray()
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def __len__(self) -> int:
        return self.vocab_size
