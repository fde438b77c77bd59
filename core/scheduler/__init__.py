"""The scheduler core: continuous batching over the KV pool, below the engines' front ends.

`Scheduler` (scheduler.py) runs the step loop over requests (`Req`, request.py): it launches the
next batch and then reads the previous step's tokens (overlap.py holds the future-token ring and the
launched step). admission.py chooses which requests may run and prefill; queues.py holds the waiting
and running requests and releases, preempts and rolls them back; launcher.py forwards and samples a
batch. Batches are built by batch_builder.py and, for a decode batch of the same requests, advanced
in place by decode_state.py; prefix_cache.py and radix.py share prompt prefixes' KV; stopping.py and
sampling_state.py finish and sample requests.
Nothing here imports `backplane.engine`.
"""

from backplane.scheduler.request import FinishReason, Req, RequestOutput
from backplane.scheduler.sampling_params import SamplingParams
from backplane.scheduler.scheduler import Scheduler

__all__ = ["FinishReason", "Req", "RequestOutput", "SamplingParams", "Scheduler"]
