"""LogitsProcessor: picks the rows that need logits and projects them onto the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backplane.contracts.batch import ForwardBatch, ForwardMode
from backplane.layers.parallel import ParallelContext


def select_logits_rows(batch: ForwardBatch) -> torch.Tensor | None:
    """Token indices whose logits are computed, or None for every token.

    `batch.logits_indices` when set; else the last new token of each request for EXTEND and
    DRAFT_EXTEND (from the device-side extend_seq_lens, no host sync); every token for DECODE
    and TARGET_VERIFY.
    """
    if batch.logits_indices is not None:
        return batch.logits_indices
    if batch.forward_mode in (ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND):
        if batch.extend_seq_lens is None:
            raise ValueError(f"{batch.forward_mode.name} batch: expected extend_seq_lens, got None")
        return torch.cumsum(batch.extend_seq_lens, dim=0) - 1
    return None


class LogitsProcessor(nn.Module):
    """hidden [T, hidden] (final-normed) -> logits [num_selected, vocab_size] fp32.

    The matmul runs in the model dtype (for a vocabulary-sized weight an fp32 copy would be too
    costly); the result is cast to fp32 before the optional soft-cap
    `cap * tanh(logits / cap)` (`final_logit_softcapping`).

    `out`, when given (the ForwardContext's `logits_out`), is a caller-owned fp32 [rows >= num_selected, vocab]
    buffer whose leading rows the cast writes into (and that view is returned): the CUDA graph
    runner gives every captured graph that one buffer, so no graph keeps a vocabulary-sized output
    of its own.
    """

    def __init__(self, vocab_size: int, parallel: ParallelContext, final_logit_softcapping: float | None = None):
        super().__init__()
        self.vocab_size = vocab_size
        self.parallel = parallel
        self.softcap = float(final_logit_softcapping or 0.0)

    def forward(self, hidden_states: torch.Tensor, lm_head: nn.Module, batch: ForwardBatch,
                out: torch.Tensor | None = None) -> torch.Tensor:
        rows = select_logits_rows(batch)
        if rows is not None:
            hidden_states = hidden_states[rows]
        logits = F.linear(hidden_states, lm_head.weight, getattr(lm_head, "bias", None))
        logits = self.parallel.all_gather_last_dim(logits)[:, : self.vocab_size]
        if out is None:
            logits = logits.float()
        else:
            rows, vocab = logits.shape
            if out.dtype != torch.float32 or out.dim() != 2 or out.shape[0] < rows or out.shape[1] != vocab:
                raise ValueError(f"logits_out: expected an fp32 buffer of at least {rows} rows of {vocab}, "
                                 f"got {out.dtype} {tuple(out.shape)}")
            logits = out[:rows].copy_(logits)
        if self.softcap > 0:
            logits = logits.div_(self.softcap).tanh_().mul_(self.softcap)
        return logits
