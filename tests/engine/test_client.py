"""The client Protocols (backplane.engine.client) and the typed process messages (messages.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import pickle

import pytest

from backplane import AsyncEngine, Engine, SamplingParams
from backplane.engine.client import EngineClient, StreamingEngineClient
from backplane.engine.messages import AddRequests, Ready, Step, StepRow, Verdict
from test_async_engine import TINY


def check_client(engine) -> None:
    """Every member of EngineClient answers with the documented type."""
    assert isinstance(engine, EngineClient)
    used, total = engine.kv_usage
    assert 0 <= used <= total and engine.num_running >= 0 and engine.num_waiting >= 0
    assert engine.context_len > 0 and engine.pid > 0 and engine.dead is None
    assert isinstance(engine.decode([72, 105]), str) and "hit_rate" in engine.prefix_cache_stats
    assert engine.args.model == "tiny-llama"


def test_engine_is_a_client_but_not_a_streaming_one():
    engine = Engine("tiny-llama", **TINY)
    check_client(engine)
    assert not isinstance(engine, StreamingEngineClient)
    engine.shutdown()
    assert engine.dead == "the engine was shut down"


def test_async_engine_is_a_streaming_client():
    engine = AsyncEngine("tiny-llama", **TINY)
    try:
        check_client(engine)
        assert isinstance(engine, StreamingEngineClient)

        async def one():
            streams = await engine.start_requests([[1, 72, 105]], [SamplingParams(max_new_tokens=3)])
            return [c async for c in streams[0]][-1].num_output_tokens

        assert asyncio.run(one()) == 3
    finally:
        engine.shutdown()


def test_an_object_missing_a_member_is_not_a_client():
    class Partial:
        args = tokenizer = None
        context_len = pid = 1

        def decode(self, ids):
            return ""

    assert not isinstance(Partial(), EngineClient)


@pytest.mark.parametrize("message", [
    AddRequests(3, [7, 8], [[1, 2], [3]], [SamplingParams(), SamplingParams(max_new_tokens=2)], "a"),
    Verdict(3, "QueueFullError", "full"),
    Step(1.5, [StepRow(7, [4], [-0.5], None, None, None, 1)], {"num_running": 1}),
    Ready(12, 2048, (None, 512, None), {}),
])
def test_messages_survive_the_pipe(message):
    back = pickle.loads(pickle.dumps(message))
    assert back == message and type(back) is type(message)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(back, dataclasses.fields(back)[0].name, None)  # frozen: a message is never changed in flight
