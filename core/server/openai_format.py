"""The OpenAI response shapes: completions and chat completions, whole or as stream chunks.

A `Choice` gathers one output (prompt i, sample j) as its chunks arrive; the formatters turn
choices into the response object, and single chunks into stream objects or, already encoded,
server-sent events (`chunk_event`: the envelope is encoded once per response, only the choice
once per chunk).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable


# One compact encoder for every event (json.dumps with separators= builds a new one per call).
JSON = json.JSONEncoder(separators=(",", ":"))
_SLOT = "\x00choice"  # stands for the choice while the chunk envelope is encoded


def sse(obj: Any) -> bytes:
    """One server-sent event: `data: {json}` and a blank line."""
    return b"data: " + JSON.encode(obj).encode() + b"\n\n"


def finite(logprob: float) -> float | None:
    """A log-probability as JSON can carry it: NaN or infinity becomes null (JSON has no NaN)."""
    return logprob if math.isfinite(logprob) else None


@dataclass
class Choice:
    index: int
    num_prompt_tokens: int
    prompt_token_ids: list[int] | None = None
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None

    def add(self, chunk: Any) -> None:
        self.text.append(chunk.text)
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        self.finish_reason, self.error = chunk.finish_reason, chunk.error


def usage(choices: list[Choice], n: int) -> dict[str, int]:
    """Prompt tokens count once per prompt (not once per sample), as OpenAI and vLLM do."""
    prompt = sum(c.num_prompt_tokens for c in choices[::n])
    completion = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Formatter:
    """Shared envelope: id, object, created, model; subclasses fill the choices."""

    object_name = ""
    chunk_object_name = ""
    id_prefix = ""

    def __init__(self, model: str, decode_token: Callable[[int], str], logprobs: bool, token_ids: bool):
        self.model, self.decode_token, self.with_logprobs, self.with_token_ids = model, decode_token, logprobs, token_ids
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._event_parts: tuple[bytes, bytes] | None = None  # a chunk event around its choice

    def _envelope(self, obj: str, choices: list[dict], usage_: dict | None) -> dict[str, Any]:
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage_ is not None or obj == self.object_name:
            out["usage"] = usage_
        return out

    def response(self, choices: list[Choice], n: int) -> dict[str, Any]:
        return self._envelope(self.object_name, [self.choice(c) for c in choices], usage(choices, n))

    def usage_chunk(self, choices: list[Choice], n: int) -> dict[str, Any]:
        return self._envelope(self.chunk_object_name, [], usage(choices, n))

    def _extras(self, token_ids: list[int], prompt_token_ids: list[int] | None) -> dict[str, Any]:
        if not self.with_token_ids:
            return {}
        out: dict[str, Any] = {"token_ids": token_ids}
        if prompt_token_ids is not None:
            out["prompt_token_ids"] = prompt_token_ids
        return out

    def chunk(self, c: Choice, piece: Any, first: bool) -> dict[str, Any]:
        """The stream object of one chunk (`piece`, a StreamChunk) of choice `c`."""
        return self._envelope(self.chunk_object_name, [self.chunk_choice(c, piece, first)], None)

    def chunk_event(self, c: Choice, piece: Any, first: bool) -> bytes:
        """sse(chunk(c, piece, first)), byte for byte, encoding only the choice."""
        if self._event_parts is None:
            event = sse(self._envelope(self.chunk_object_name, [_SLOT], None))
            head, tail = event.rsplit(JSON.encode(_SLOT).encode(), 1)  # choices come after the model name
            self._event_parts = head, tail
        head, tail = self._event_parts
        return head + JSON.encode(self.chunk_choice(c, piece, first)).encode() + tail

    def choice(self, c: Choice) -> dict[str, Any]:
        raise NotImplementedError

    def chunk_choice(self, c: Choice, piece: Any, first: bool) -> dict[str, Any]:
        raise NotImplementedError


class CompletionFormatter(Formatter):
    object_name = chunk_object_name = "text_completion"
    id_prefix = "cmpl"

    def _logprobs(self, token_ids: list[int], logprobs: list[float]) -> dict[str, Any] | None:
        if not self.with_logprobs:
            return None
        tokens = [self.decode_token(t) for t in token_ids]
        offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        return {"tokens": tokens, "token_logprobs": [finite(lp) for lp in logprobs], "top_logprobs": None, "text_offset": offsets}

    def choice(self, c: Choice) -> dict[str, Any]:
        return {"index": c.index, "text": "".join(c.text), "logprobs": self._logprobs(c.token_ids, c.logprobs),
                "finish_reason": c.finish_reason, **self._extras(c.token_ids, c.prompt_token_ids)}

    def chunk_choice(self, c: Choice, piece: Any, first: bool) -> dict[str, Any]:
        return {"index": c.index, "text": piece.text, "logprobs": self._logprobs(piece.token_ids, piece.logprobs),
                "finish_reason": piece.finish_reason,
                **self._extras(piece.token_ids, c.prompt_token_ids if first else None)}


class ChatFormatter(Formatter):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def _logprobs(self, token_ids: list[int], logprobs: list[float]) -> dict[str, Any] | None:
        if not self.with_logprobs:
            return None
        content = []
        for t, lp in zip(token_ids, logprobs):
            token = self.decode_token(t)
            content.append({"token": token, "logprob": finite(lp), "bytes": list(token.encode()), "top_logprobs": []})
        return {"content": content}

    def choice(self, c: Choice) -> dict[str, Any]:
        message = {"role": "assistant", "content": "".join(c.text)}
        return {"index": c.index, "message": message, "logprobs": self._logprobs(c.token_ids, c.logprobs),
                "finish_reason": c.finish_reason, **self._extras(c.token_ids, c.prompt_token_ids)}

    def chunk_choice(self, c: Choice, piece: Any, first: bool) -> dict[str, Any]:
        delta = {"role": "assistant", "content": piece.text} if first else {"content": piece.text}
        return {"index": c.index, "delta": delta, "logprobs": self._logprobs(piece.token_ids, piece.logprobs),
                "finish_reason": piece.finish_reason,
                **self._extras(piece.token_ids, c.prompt_token_ids if first else None)}
