"""The scheduler core: continuous batching over the KV pool, below the engines' front ends.

`Scheduler` (scheduler.py) admits, prefills, decodes and finishes requests (`Req`, request.py);
its step launches the next batch and then reads the previous step's tokens (overlap.py holds the
future-token ring and the launched step). Batches are built by batch_builder.py and, for a decode
batch of the same requests, advanced in place by decode_state.py; prefix_cache.py and radix.py
share prompt prefixes' KV; stopping.py and sampling_state.py finish and sample requests.
Nothing here imports `backplane.engine`.
"""

from backplane.scheduler.request import FinishReason, Req, RequestOutput
from backplane.scheduler.sampling_params import SamplingParams
from backplane.scheduler.scheduler import Scheduler

__all__ = ["FinishReason", "Req", "RequestOutput", "SamplingParams", "Scheduler"]
