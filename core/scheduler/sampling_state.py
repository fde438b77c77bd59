"""Per-batch sampling settings, built once when the batch's requests change.

Settings that are valid but underflow in float32 get their limit: a temperature that rounds to 0
samples greedily, a min_p that rounds to 0 filters nothing, and a top_p is kept at least the smallest
normal float32 (only the most likely token).

A decode batch usually holds the same requests step after step, so the settings tensors are
kept and reused until the set of requests (in order) differs; an all-greedy batch builds none,
since the sampler's greedy path never reads them.
"""

from __future__ import annotations

import torch

from backplane.scheduler.request import Req
from backplane.layers.sampler import SamplingBatch

_EMPTY = torch.empty(0)
_TINY = torch.finfo(torch.float32).tiny


class SamplingCache:
    """The SamplingBatch of the last batch, rebuilt only when its request ids differ."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._batch: SamplingBatch | None = None

    def get(self, reqs: list[Req], device: torch.device) -> SamplingBatch:
        key = (str(device), *(r.rid for r in reqs))
        if key != self._key or self._batch is None:
            self._key, self._batch = key, sampling_batch(reqs, device)
        return self._batch


def sampling_batch(reqs: list[Req], device: torch.device) -> SamplingBatch:
    """Device tensors of the requests' settings (none for an all-greedy batch)."""
    params = [r.params for r in reqs]
    if all(p.is_greedy for p in params):
        return SamplingBatch(_EMPTY, _EMPTY, _EMPTY, _EMPTY, [None] * len(reqs), all_greedy=True)
    # NOTE: a top_p below float32's smallest normal number would round to 0 and keep no token at all;
    # its limit keeps only the most likely token, which the smallest positive top_p does.
    values = torch.tensor([[p.temperature, max(p.top_k, 0), max(p.top_p, _TINY), p.min_p] for p in params],
                          dtype=torch.float64).to(device, non_blocking=True)  # one copy, no stream sync; top_k is exact in float64
    return SamplingBatch(
        temperatures=values[:, 0].float(), top_ks=values[:, 1].long(), top_ps=values[:, 2].float(),
        min_ps=values[:, 3].float(), generators=[r.generator for r in reqs], all_greedy=False,
    )
