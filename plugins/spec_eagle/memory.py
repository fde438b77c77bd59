"""The draft head's KV memory: its own one-layer pool and request pool, on the target's slot numbers.

Slot s of the draft pool holds the draft's K/V for the token whose target K/V is in slot s, so the
draft reads the cached prefix through the same slot numbers. Each target row r owns `topk` beam rows
(r * topk + j) in the draft's request pool; their columns 0..num_cached mirror the target row, and
the columns after the root hold fixed scratch slots (numbered past the target's slots), one per
drafting depth.
"""

from __future__ import annotations

import torch

from backplane import ReqToTokenPool, TokenToKVPool


class DraftMemory:
    def __init__(self, runner, layer_info, topk: int, num_steps: int):
        target_rows, target_kv = runner.req_to_token_pool, runner.token_to_kv_pool
        self.topk, self.depths = topk, max(num_steps - 1, 0)
        self.device = runner.device
        self.req_pool = ReqToTokenPool(target_rows.size * topk, target_rows.max_context_len + num_steps, runner.device)
        self.scratch_base = target_kv.num_slots + 1
        num_scratch = target_rows.size * topk * self.depths
        try:
            self.kv_pool = TokenToKVPool(target_kv.num_slots + num_scratch, 1, layer_info.num_kv_heads,
                                         layer_info.head_dim, runner.dtype, runner.device)
        except torch.OutOfMemoryError as exc:
            raise ValueError(
                f"EAGLE draft KV pool: {target_kv.num_slots + num_scratch} slots do not fit; lower "
                "--mem-fraction-static or pass a smaller --max-total-tokens") from exc

    def beam_rows(self, target_rows: list[int]) -> torch.Tensor:
        """[len(target_rows) * topk] the beam rows, request after request (host int64)."""
        rows = torch.tensor(target_rows, dtype=torch.int64)
        return (rows[:, None] * self.topk + torch.arange(self.topk)).view(-1)

    def scratch(self, beam_rows: torch.Tensor) -> torch.Tensor:
        """[len(beam_rows), depths] the scratch slot of each beam at depths 1..depths (host int64)."""
        return self.scratch_base + beam_rows[:, None] * self.depths + torch.arange(self.depths)

    def write_rows(self, beam_rows: torch.Tensor, cols: torch.Tensor, slots: torch.Tensor) -> None:
        """req_to_token[beam_rows[i], cols[i]] = slots[i] (host or device int tensors of one length)."""
        r2t = self.req_pool.req_to_token
        r2t[beam_rows.to(self.device), cols.to(self.device)] = slots.to(self.device, torch.int32)
