"""The server is written against the StreamingEngineClient Protocol: an AsyncEngine serves, and an
object that is not a streaming engine is refused in one line when the app is built."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from backplane import AsyncEngine, Engine  # noqa: E402
from backplane.engine.client import StreamingEngineClient  # noqa: E402
from backplane.server.app import build_app  # noqa: E402


def test_a_blocking_engine_is_not_a_server_engine():
    engine = Engine("tiny-llama", device="cpu", max_total_tokens=256)
    assert not isinstance(engine, StreamingEngineClient)
    with pytest.raises(TypeError, match=r"^build_app: expected a StreamingEngineClient .* got Engine$"):
        build_app(engine)


def test_an_async_engine_builds_the_app():
    engine = AsyncEngine(engine=Engine("tiny-llama", device="cpu", max_total_tokens=256))
    try:
        assert isinstance(engine, StreamingEngineClient)
        assert build_app(engine).state.server.engine is engine
    finally:
        engine.shutdown()
