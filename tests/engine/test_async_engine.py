"""AsyncEngine: streams equal Engine.generate, abort frees the KV pool at once, a failing forward
fails only its request, the queue cap refuses, and IncrementalText releases only final text."""

from __future__ import annotations

import asyncio

import pytest

from backplane import AsyncEngine, AttentionBackendSpec, Engine, SamplingParams
from backplane.attention import TorchNativeAttnBackend
from backplane.engine.async_engine import QueueFullError, RequestRejected
from backplane.text.detokenize import MAX_WAITING_TOKENS, IncrementalText
from backplane.models.byte_tokenizer import ByteTokenizer
from backplane.plugin.hookspecs import hookimpl

TINY = dict(device="cpu", attention_backend="torch_native", max_total_tokens=4096)
GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 72, 101, 108], [1, 200, 3, 9, 44, 250], [1, 5]]
POISON = 497


class FailingBackend(TorchNativeAttnBackend):
    def forward_extend(self, q, k, v, layer, batch):
        if bool((batch.input_ids == POISON).any()):
            raise RuntimeError(f"poisoned batch: token {POISON}")
        return super().forward_extend(q, k, v, layer, batch)


class FailingPlugin:
    @hookimpl
    def backplane_register_attention_backends(self, register):
        register(AttentionBackendSpec(name="failing", factory=FailingBackend, description="fails on a token",
                                      platforms=("cpu",), dtypes=("float32",), priority=-1))


@pytest.fixture(scope="module")
def engine():
    e = AsyncEngine("tiny-llama", max_queued_requests=8, **TINY)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def reference():
    return Engine("tiny-llama", **TINY).generate(input_ids=PROMPTS, sampling_params=GREEDY)


async def _drain(stream):
    chunks = [c async for c in stream]
    return chunks, [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks)


def test_streams_equal_generate(engine, reference):
    async def run():
        streams = [engine.add_request(p, GREEDY) for p in PROMPTS]
        return await asyncio.gather(*map(_drain, streams))

    for (chunks, ids, text), ref in zip(asyncio.run(run()), reference):
        assert ids == ref.token_ids and text == ref.text
        assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])
        assert chunks[-1].num_output_tokens == 10
    assert engine.kv_usage[0] == 0 and engine.num_running == 0 and engine.num_waiting == 0


def test_one_loop_callback_per_step_serves_every_stream(engine, monkeypatch):
    """The engine thread hands the loop one callback per step for all its streams, never one per
    stream or token (each costs the engine a wake-up of the loop and a turn at the GIL)."""
    steps, callbacks = [], []
    step = engine.engine._step
    monkeypatch.setattr(engine.engine, "_step", lambda: steps.append(1) or step())

    async def run():
        loop = asyncio.get_running_loop()
        schedule = loop.call_soon_threadsafe

        def counting(callback, *args):
            callbacks.append(callback)
            return schedule(callback, *args)

        loop.call_soon_threadsafe = counting
        streams = engine.add_requests([[1, 30 + i, 40] for i in range(8)], [GREEDY] * 8)
        return await asyncio.gather(*map(_drain, streams))

    results = asyncio.run(run())
    assert [len(ids) for _, ids, _ in results] == [10] * 8  # 80 tokens in all
    assert 10 <= len(steps) and 1 <= len(callbacks) <= len(steps)


def test_abort_frees_the_kv_pool_before_the_next_step(engine):
    async def run():
        stream = engine.add_request([1, 50, 60], SamplingParams(max_new_tokens=1000, temperature=0.0, ignore_eos=True))
        first = await stream.__anext__()
        used_while_running = engine.kv_usage[0]
        engine.abort(stream.rid)
        rest = [c async for c in stream]
        return first, used_while_running, rest

    first, used, rest = asyncio.run(run())
    assert used >= 3 and rest[-1].finish_reason == "abort" and "aborted" in rest[-1].error
    assert first.num_output_tokens + sum(len(c.token_ids) for c in rest) < 1000
    assert engine.kv_usage[0] == 0 and engine.num_running == 0  # freed when the abort chunk was sent


def test_closing_a_stream_aborts_it(engine):
    async def run():
        stream = engine.add_request([1, 7], SamplingParams(max_new_tokens=1000, temperature=0.0, ignore_eos=True))
        await stream.__anext__()
        await stream.aclose()
        while not stream.finished:
            await stream.__anext__()
        return stream

    assert asyncio.run(run()).finish_reason == "abort"
    assert engine.kv_usage[0] == 0


def test_rejections_are_synchronous(engine):
    async def run():
        with pytest.raises(RequestRejected, match="exceeds the context length 2048"):
            engine.add_request([1] * 2040, SamplingParams(max_new_tokens=20))
        with pytest.raises(RequestRejected, match="unknown LoRA adapter 'nope'"):
            engine.add_request([1, 2], GREEDY, lora="nope")
        with pytest.raises(QueueFullError, match="the limit is 8"):
            engine.add_requests([[1, 2]] * 9, [GREEDY] * 9)

    asyncio.run(run())
    assert engine.num_waiting == 0


def test_a_failing_forward_fails_only_its_request(reference):
    engine = AsyncEngine("tiny-llama", plugins=[FailingPlugin()], **{**TINY, "attention_backend": "failing"})
    try:
        async def run():
            streams = [engine.add_request(p, GREEDY) for p in [PROMPTS[0], [1, POISON, 8], PROMPTS[1]]]
            return await asyncio.gather(*map(_drain, streams))

        (_, ids0, _), (bad, _, _), (_, ids2, _) = asyncio.run(run())
        assert bad[-1].finish_reason == "abort" and f"poisoned batch: token {POISON}" in bad[-1].error
        assert ids0 == reference[0].token_ids and ids2 == reference[1].token_ids
        assert engine.kv_usage[0] == 0 and engine.dead is None
    finally:
        engine.shutdown()


def test_incremental_text_waits_for_whole_characters():
    tok = ByteTokenizer()
    text = "héllo wörld ✓!"
    ids = tok.encode(text, add_special_tokens=False)
    inc, pieces = IncrementalText(tok.decode), []
    for i in range(1, len(ids) + 1):
        pieces.append(inc.update(ids[:i], finished=i == len(ids)))
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert pieces[:3] == ["h", "", "é"]  # é is two bytes: nothing until both came


def test_incremental_text_holds_back_a_possible_stop_string():
    tok = ByteTokenizer()
    ids = tok.encode("abcdef", add_special_tokens=False)
    inc = IncrementalText(tok.decode, holdback=2)
    assert inc.update(ids[:4]) == "ab"  # "cd" might start a 3-character stop string
    assert inc.update(ids[:5], final_text="abc") == "c"  # the engine cut the text at the stop


def _recording(decode):
    windows = []

    def record(ids):
        windows.append(len(ids))
        return decode(ids)
    return record, windows


def test_incremental_text_window_moves_past_tokens_without_text():
    tok = ByteTokenizer()
    text_ids = tok.encode("héllo", add_special_tokens=False)
    # ids past the byte range decode to nothing (as most ids of a large vocabulary do for this tokenizer)
    ids = [300 + i for i in range(200)] + text_ids + [400] * 50 + tok.encode("✓", add_special_tokens=False)
    decode, windows = _recording(tok.decode)
    inc = IncrementalText(decode)
    pieces = [inc.update(ids[:i], finished=i == len(ids)) for i in range(1, len(ids) + 1)]
    assert "".join(pieces) == tok.decode(ids) == "héllo✓"
    assert max(windows) <= 4  # a few tokens a step, not the whole output (the window used to stay at 0)


def test_incremental_text_waits_at_most_the_cap_on_invalid_utf8():
    tok = ByteTokenizer()
    ids = tok.encode("a", add_special_tokens=False) + [0x80 + 3] * 100  # lone continuation bytes: never whole
    decode, windows = _recording(tok.decode)
    inc = IncrementalText(decode)
    pieces = [inc.update(ids[:i], finished=i == len(ids)) for i in range(1, len(ids) + 1)]
    assert "".join(pieces) == tok.decode(ids) and "".join(pieces[:MAX_WAITING_TOKENS + 3]).startswith("a\ufffd")
    assert max(windows) <= 2 * MAX_WAITING_TOKENS + 2
