"""ModelOutput: what a model's forward returns."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ModelOutput:
    """logits: [num_selected, vocab_size] fp32 (rows chosen by LogitsProcessor).

    hidden_states: [num_tokens, hidden_size], the final-normed hidden state of every token when
    `batch.capture_hidden` is true (EAGLE drafts from it), else None.
    """

    logits: torch.Tensor
    hidden_states: torch.Tensor | None = None
