"""ProcessEngine (the engine of `backplane serve` in a spawned process): streams equal
Engine.generate, an abort frees the KV pool, refusals carry the thread mode's messages, a failing
forward fails only its request, and shutdown leaves no process."""

from __future__ import annotations

import asyncio
import os

import pytest

from backplane import SamplingParams
from backplane.engine.engine_loop import QueueFullError, RequestRejected
from backplane.engine.process_engine import ProcessEngine
from backplane.plugin.manager import load_plugins
from backplane.settings import build_server_args
from test_async_engine import GREEDY, POISON, PROMPTS, TINY, FailingPlugin, _drain


def _args(**overrides):
    return build_server_args({"model": "tiny-llama", **TINY, **overrides}, load_plugins().settings_groups(), None)


@pytest.fixture(scope="module")
def engine():
    e = ProcessEngine(_args(), max_queued_requests=8)
    yield e
    e.shutdown()
    assert not e.process.is_alive() and e.process.exitcode == 0


@pytest.fixture(scope="module")
def reference():
    from backplane import Engine

    return Engine("tiny-llama", **TINY).generate(input_ids=PROMPTS, sampling_params=GREEDY)


async def _idle(engine, timeout: float = 5.0) -> None:
    """Wait for the stats the engine process sends once it is idle."""
    for _ in range(int(timeout / 0.01)):
        if engine.kv_usage[0] == 0 and engine.num_running == 0:
            return
        await asyncio.sleep(0.01)


def test_streams_equal_generate_in_another_process(engine, reference):
    async def run():
        streams = await engine.start_requests(PROMPTS, [GREEDY] * len(PROMPTS))
        results = await asyncio.gather(*map(_drain, streams))
        await _idle(engine)
        return results

    assert engine.pid == engine.process.pid != os.getpid()
    # the engine process froze its startup heap (freeze_startup_heap): torch, transformers and the
    # model's objects, far more than 10,000, leave its full garbage collections
    assert engine.gc_frozen > 10_000
    for (chunks, ids, text), ref in zip(asyncio.run(run()), reference):
        assert ids == ref.token_ids and text == ref.text and chunks[-1].finish_reason == "length"
    assert engine.kv_usage[0] == 0 and engine.num_running == 0 and engine.num_waiting == 0


def test_abort_frees_the_kv_pool(engine):
    async def run():
        [stream] = await engine.start_requests([[1, 50, 60]], [SamplingParams(max_new_tokens=1000, ignore_eos=True)])
        await stream.__anext__()
        await stream.aclose()
        rest = [c async for c in stream]
        await _idle(engine)
        return rest

    rest = asyncio.run(run())
    assert rest[-1].finish_reason == "abort" and "aborted" in rest[-1].error
    assert engine.kv_usage[0] == 0


def test_refusals_carry_the_thread_modes_messages(engine):
    async def run():
        with pytest.raises(RequestRejected, match=r"request \d+: prompt of 2040 tokens .* context length 2048"):
            await engine.start_requests([[1] * 2040], [SamplingParams(max_new_tokens=20)])
        with pytest.raises(RequestRejected, match="unknown LoRA adapter 'nope'"):
            await engine.start_requests([[1, 2]], [GREEDY], lora="nope")
        with pytest.raises(QueueFullError, match="0 requests are waiting, the limit is 8"):
            await engine.start_requests([[1, 2]] * 9, [GREEDY] * 9)

    asyncio.run(run())
    assert engine.num_waiting == 0


def test_a_failing_forward_fails_only_its_request(reference):
    engine = ProcessEngine(_args(attention_backend="failing"), plugins=[FailingPlugin()])
    try:
        async def run():
            streams = await engine.start_requests([PROMPTS[0], [1, POISON, 8], PROMPTS[1]], [GREEDY] * 3)
            return await asyncio.gather(*map(_drain, streams))

        (_, ids0, _), (bad, _, _), (_, ids2, _) = asyncio.run(run())
        assert bad[-1].finish_reason == "abort" and f"poisoned batch: token {POISON}" in bad[-1].error
        assert ids0 == reference[0].token_ids and ids2 == reference[1].token_ids
        assert engine.dead is None
    finally:
        engine.shutdown()
    assert not engine.process.is_alive()


def test_process_engine_is_a_streaming_client(engine):
    from backplane.engine.client import StreamingEngineClient
    from test_client import check_client

    check_client(engine)
    assert isinstance(engine, StreamingEngineClient)
