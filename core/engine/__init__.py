"""The engines: Engine (blocking), AsyncEngine (streaming), and SamplingParams/RequestOutput re-exported from
the continuous-batching scheduler (backplane.scheduler)."""

from backplane.engine.async_engine import AsyncEngine, RequestStream, StreamChunk
from backplane.engine.engine import Engine
from backplane.scheduler.request import RequestOutput
from backplane.scheduler.sampling_params import SamplingParams

__all__ = ["AsyncEngine", "Engine", "RequestStream", "StreamChunk", "RequestOutput", "SamplingParams"]
