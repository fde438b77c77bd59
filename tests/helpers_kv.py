"""Shared test helper: an FP8 KV pool with its requests' slots shuffled, for the attention kernels'
CPU (interpreted) and GPU tests."""

from __future__ import annotations

import torch

from backplane.contracts.memory import quantize_fp8


def shuffled_fp8_pool(seq_lens: list[int], gen: torch.Generator, kv_heads: int, head_dim: int,
                      scales: tuple[float, float], device: str | torch.device = "cpu"):
    """FP8 K/V buffers [slots + 1, kv_heads, head_dim] of N(0, 1) values quantized with scales (k, v)
    (slot 0 unused, some slots never used), req_to_token rows holding each request's slots in a
    shuffled order, and the requests' rows (shuffled too, never 0..bs-1): (k, v, req_to_token, rows)."""
    num_slots = sum(seq_lens) + 13
    k_buf, v_buf = (quantize_fp8(torch.randn(num_slots + 1, kv_heads, head_dim, generator=gen), s).to(device)
                    for s in scales)
    slots = torch.randperm(num_slots, generator=gen)[:sum(seq_lens)] + 1
    req_to_token = torch.zeros(len(seq_lens) + 3, max(seq_lens) + 8, dtype=torch.int32)
    rows = torch.randperm(len(seq_lens) + 3, generator=gen)[:len(seq_lens)]
    for row, chunk in zip(rows, slots.split(seq_lens)):
        req_to_token[row, :len(chunk)] = chunk.int()
    return k_buf, v_buf, req_to_token.to(device), rows.to(device)
