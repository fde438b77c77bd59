"""Engine lifetime (issue 42): a stream left early aborts its request, a failed add_request gives
its queue place back, generate is refused while an AsyncEngine drives the engine, and an
AsyncEngine dropped without shutdown() frees its thread and engine."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref

import pytest

from backplane import AsyncEngine, Engine, SamplingParams
from backplane.engine.engine_loop import QueueFullError
from test_async_engine import TINY

LONG = SamplingParams(max_new_tokens=1500, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    e = AsyncEngine("tiny-llama", max_queued_requests=1, **TINY)
    yield e
    e.shutdown()


def wait_idle(engine, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.num_running == 0 and engine.kv_usage[0] == 0:
            return True
        time.sleep(0.01)
    return False


def running_req(engine):
    return engine.scheduler.running[0]


def test_break_out_of_async_for_aborts_the_request(engine):
    seen = {}

    async def consume():
        async for _chunk in engine.add_request(input_ids=[1, 72, 105], params=LONG):
            seen["req"] = running_req(engine)
            break

    asyncio.run(consume())
    gc.collect()
    assert wait_idle(engine), f"the request kept running: {engine.num_running} running, KV {engine.kv_usage}"
    req = seen["req"]
    assert req.finish_reason.value == "abort" and len(req.output_ids) < LONG.max_new_tokens


def test_a_cancelled_consumer_aborts_the_request(engine):
    seen = {}

    async def main():
        first = asyncio.Event()

        async def consume():
            async for _ in engine.add_request(input_ids=[1, 80, 90], params=LONG):
                seen.setdefault("req", running_req(engine))
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert wait_idle(engine)
    assert seen["req"].finish_reason.value == "abort" and len(seen["req"].output_ids) < LONG.max_new_tokens


def test_add_request_off_an_event_loop_keeps_no_queue_place(engine):
    for _ in range(3):
        with pytest.raises(RuntimeError, match=r"expected to be called on a running asyncio event loop"):
            engine.add_request(input_ids=[1, 2, 3])
    assert engine.num_waiting == 0

    async def one():  # max_queued_requests=1: a place leaked above would refuse this one
        return [c async for c in engine.add_request(input_ids=[1, 2, 3], params=SamplingParams(max_new_tokens=2))]

    assert asyncio.run(one())[-1].finish_reason == "length"


def test_a_refused_request_counts_nothing(engine):
    async def flood():
        first = engine.add_request(input_ids=[1, 2, 3], params=SamplingParams(max_new_tokens=2))
        with pytest.raises(QueueFullError):
            engine.add_request(input_ids=[1, 2, 3])
        return [c async for c in first]

    asyncio.run(flood())
    assert wait_idle(engine) and engine.num_waiting == 0


def test_generate_is_refused_while_an_async_engine_drives_the_engine(engine):
    with pytest.raises(RuntimeError, match=r"Engine.generate: this engine is driven by an AsyncEngine"):
        engine.engine.generate(input_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_new_tokens=2))
    with pytest.raises(RuntimeError, match=r"already driven by an AsyncEngine"):
        AsyncEngine(engine=engine.engine)
    assert engine.dead is None and engine._thread.is_alive()


def test_a_dropped_async_engine_frees_its_thread_and_engine():
    inner = Engine("tiny-llama", **TINY)
    outer = AsyncEngine(engine=inner)
    thread, engine_ref = outer._thread, weakref.ref(inner)
    del outer
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()
    out = inner.generate(input_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_new_tokens=2))
    assert out[0].finish_reason == "length"  # the engine is handed back
    del inner, out
    gc.collect()
    assert engine_ref() is None
