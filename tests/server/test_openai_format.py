"""The OpenAI response shapes carry no NaN (JSON has none: a non-finite log-probability is null),
a stream chunk encoded from the per-response template equals the whole chunk encoded, and the
last chunk leaves with the usage and `[DONE]` in one write."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

pytest.importorskip("fastapi")

from backplane.engine.stream import Delta, RequestStream, StreamChunk  # noqa: E402
from backplane.models.byte_tokenizer import ByteTokenizer  # noqa: E402
from backplane.server.generation import Generation, event_stream  # noqa: E402
from backplane.server.metrics import ServerMetrics  # noqa: E402
from backplane.server.openai_format import ChatFormatter, Choice, CompletionFormatter, sse  # noqa: E402


@pytest.mark.parametrize("formatter", [CompletionFormatter, ChatFormatter])
def test_non_finite_logprobs_become_null(formatter):  # docs/reliability.md R69
    fmt = formatter("tiny-llama", lambda t: f"<{t}>", True, False)
    choice = Choice(index=0, num_prompt_tokens=3, token_ids=[5, 6, 7], logprobs=[-0.5, math.nan, -math.inf],
                    text=["<5>", "<6>", "<7>"], finish_reason="length")
    body = json.dumps(fmt.choice(choice), allow_nan=False)  # raises on a bare NaN or Infinity
    logprobs = json.loads(body)["logprobs"]
    got = logprobs["token_logprobs"] if formatter is CompletionFormatter else [c["logprob"] for c in logprobs["content"]]
    assert got == [-0.5, None, None]


@pytest.mark.parametrize("formatter", [CompletionFormatter, ChatFormatter])
@pytest.mark.parametrize("logprobs, token_ids", [(False, False), (True, True)])
def test_chunk_event_equals_the_encoded_chunk(formatter, logprobs, token_ids):
    fmt = formatter('model "q"\x00choice', lambda t: f"<{t}>", logprobs, token_ids)  # a name that looks like the slot
    choice = Choice(index=2, num_prompt_tokens=3, prompt_token_ids=[1, 2, 3])
    pieces = [StreamChunk([7, 8], [-0.25, math.nan], 'a"\u00e9\n', None, None, 3, 2, 1.0, [1.0, 1.0]),
              StreamChunk([9], [-1.5], "", "length", None, 3, 3, 2.0, [2.0])]
    for first, piece in zip([True, False], pieces):
        event = fmt.chunk_event(choice, piece, first)
        assert event == sse(fmt.chunk(choice, piece, first))
        body = json.loads(event.removeprefix(b"data: "))
        assert body["choices"][0]["index"] == 2 and body["model"] == 'model "q"\x00choice'
        assert ("prompt_token_ids" in body["choices"][0]) == (first and token_ids)


class _Connected:
    """An ASGI request whose client never disconnects."""

    async def receive(self):
        await asyncio.Event().wait()


class _Gauges:
    num_running = num_waiting = 0
    kv_usage = (0, 1)
    prefix_cache_stats = {"cached_tokens": 0, "hit_rate": 0.0}


def test_last_chunk_usage_and_done_leave_in_one_write():
    async def run():
        stream = RequestStream(0, 3, 0.0, asyncio.get_running_loop(), ByteTokenizer().decode, 0, lambda s: None)
        fmt = CompletionFormatter("tiny-llama", str, False, True)
        gen = Generation([stream], [Choice(0, 3)], fmt, 1, True, [ServerMetrics(_Gauges()).timer(stream)])
        events = event_stream(_Connected(), gen)
        writes = []
        for k, token in enumerate(b"abc"):
            stream.put(Delta([token + 3], [-0.5], "length" if k == 2 else None, None, None, k + 1, float(k)))
            writes.append(await events.__anext__())
        with pytest.raises(StopAsyncIteration):
            await events.__anext__()
        return writes

    writes = asyncio.run(run())
    assert [w.count(b"data: ") for w in writes] == [1, 1, 3] and writes[-1].endswith(b"data: [DONE]\n\n")
    chunks = [json.loads(e.removeprefix(b"data: ")) for w in writes for e in w.split(b"\n\n")[:-1]
              if e != b"data: [DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks[:3]) == "abc" and chunks[2]["choices"][0]["finish_reason"] == "length"
    assert chunks[3]["choices"] == [] and chunks[3]["usage"]["completion_tokens"] == 3
