"""The offline engine: Engine, SamplingParams and the continuous-batching scheduler."""

from backplane.engine.engine import Engine
from backplane.engine.request import RequestOutput
from backplane.engine.sampling_params import SamplingParams

__all__ = ["Engine", "RequestOutput", "SamplingParams"]
