"""Sampling the next token of each request from its logits row.

Greedy rows take the argmax; a batch of greedy rows only runs the `greedy_sample` custom op chosen
for the device (one kernel under the Triton ops). Other rows: logits / temperature, then top-k,
top-p and min-p filters, then a draw. Seeded rows draw from their own generator, so a request's tokens do not
depend on what else is in the batch; unseeded rows share one generator in one batched draw.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from backplane.ops import native


@dataclass
class SamplingBatch:
    """Per-row settings, as device tensors: temperatures [bs] fp32, top_ks [bs] int64 (0: off),
    top_ps [bs] fp32, min_ps [bs] fp32; generators[i] is the row's own generator or None."""

    temperatures: torch.Tensor
    top_ks: torch.Tensor
    top_ps: torch.Tensor
    min_ps: torch.Tensor
    generators: list[torch.Generator | None]
    all_greedy: bool


def filtered_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [bs, vocab] fp32 -> probabilities after temperature, top-k, top-p and min-p."""
    temps = batch.temperatures.clamp_min(1e-6).unsqueeze(1)
    probs = torch.softmax(logits / temps, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
    top_k = torch.where(batch.top_ks > 0, batch.top_ks, probs.shape[-1]).unsqueeze(1)
    cumulative = sorted_probs.cumsum(dim=-1)
    # Keep a token while the mass before it is below top_p (the first token is always kept).
    keep = (ranks < top_k) & ((cumulative - sorted_probs) < batch.top_ps.unsqueeze(1))
    keep &= sorted_probs >= batch.min_ps.unsqueeze(1) * sorted_probs[:, :1]
    sorted_probs = sorted_probs * keep
    filtered = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
    return filtered / filtered.sum(dim=-1, keepdim=True)


def sample(logits: torch.Tensor, batch: SamplingBatch, shared: torch.Generator | None = None,
           greedy_sample: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = native.greedy_sample,
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [bs, vocab] fp32 -> (token ids [bs] int64, their log-probabilities [bs] under the model).

    greedy_sample: the `greedy_sample` op (signature of backplane.ops.native.greedy_sample) that an
    all-greedy batch runs alone; its results may be views of one buffer (LaunchedStep.launch then
    copies them to the host at once).
    """
    if batch.all_greedy:
        return greedy_sample(logits)
    logprobs = torch.log_softmax(logits, dim=-1)
    greedy = logits.argmax(dim=-1)
    probs = filtered_probs(logits, batch)
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p.
    noise = torch.empty_like(probs).exponential_(generator=shared)
    for row, gen in enumerate(batch.generators):
        if gen is not None:
            noise[row] = torch.empty_like(probs[row]).exponential_(generator=gen)
    drawn = (probs / noise).argmax(dim=-1)
    tokens = torch.where(batch.temperatures == 0, greedy, drawn)
    return tokens, logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
