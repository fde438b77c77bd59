"""A composite backend: one backend for prefill-like modes and another for decode.

Built when `--prefill-attention-backend` and `--decode-attention-backend` differ. It implements the
same AttentionBackend contract, so the rest of the executor does not know it is two backends.
"""

from __future__ import annotations

from typing import Any

import torch

from backplane.contracts.attention import AttentionBackend, AttentionLayerInfo
from backplane.contracts.batch import ForwardBatch


class HybridAttnBackend(AttentionBackend):
    def __init__(self, prefill: AttentionBackend, decode: AttentionBackend):
        self.prefill = prefill
        self.decode = decode

    def _pick(self, batch: ForwardBatch) -> AttentionBackend:
        return self.decode if batch.forward_mode.is_decode else self.prefill

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._pick(batch).init_forward_metadata(batch)

    def fuses_rotary_kv_write(self, batch: ForwardBatch) -> bool:
        return self._pick(batch).fuses_rotary_kv_write(batch)

    def forward_extend(self, q, k, v, layer: AttentionLayerInfo, batch: ForwardBatch, **kv_written) -> torch.Tensor:
        return self.prefill.forward_extend(q, k, v, layer, batch, **kv_written)

    def forward_decode(self, q, k, v, layer: AttentionLayerInfo, batch: ForwardBatch, **kv_written) -> torch.Tensor:
        return self.decode.forward_decode(q, k, v, layer, batch, **kv_written)

    def init_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Both backends' graph state; one without any (its modes captured piecewise or run eagerly:
        the graph runner captures only what each declared) is skipped."""
        for backend in {id(b): b for b in (self.prefill, self.decode)}.values():
            try:
                backend.init_graph_state(max_bs, max_num_tokens)
            except NotImplementedError:
                pass

    def init_metadata_for_capture(self, key: Any, batch: ForwardBatch) -> None:
        self._pick(batch).init_metadata_for_capture(key, batch)

    def init_metadata_for_replay(self, key: Any, batch: ForwardBatch) -> None:
        self._pick(batch).init_metadata_for_replay(key, batch)
