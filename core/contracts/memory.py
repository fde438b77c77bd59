"""KV-cache memory: the request-to-token map and the per-layer K/V token pool.

The token pool has page size 1: one slot holds one token's K and V for every layer. Slot 0 is never
handed out; CUDA-graph padding points its dummy tokens there, so whatever they write is harmless.
"""

from __future__ import annotations

import torch


class PoolExhaustedError(RuntimeError):
    """Raised when an allocation asks for more slots than are free."""


class ReqToTokenPool:
    """`req_to_token[row, position]` is the KV slot of a request's token at that position.

    req_to_token: [size, max_context_len] int32
    """

    def __init__(self, size: int, max_context_len: int, device: torch.device | str):
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=device)
        self._free_rows = list(range(size))

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int:
        if not self._free_rows:
            raise PoolExhaustedError(f"request pool: all {self.size} rows are in use")
        return self._free_rows.pop()

    def free(self, row: int) -> None:
        assert 0 <= row < self.size and row not in self._free_rows, f"bad or double free of row {row}"
        self._free_rows.append(row)


class TokenToKVPool:
    """Per-layer K and V buffers of shape [num_slots + 1, num_kv_heads, head_dim]; slot 0 is the dump slot."""

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_slots + 1, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._free = torch.arange(1, num_slots + 1, dtype=torch.int64)  # host-side free list
        self._num_free = num_slots
        self._is_free = torch.ones(num_slots + 1, dtype=torch.bool)
        self._is_free[0] = False

    @property
    def num_free(self) -> int:
        return self._num_free

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * itemsize

    def alloc(self, n: int) -> torch.Tensor:
        """Return `n` free slots as a host int64 tensor (the allocator lives on the host)."""
        if n > self._num_free:
            raise PoolExhaustedError(f"KV pool: asked for {n} slots, {self._num_free} free")
        out = self._free[self._num_free - n : self._num_free].clone()
        self._num_free -= n
        self._is_free[out] = False
        return out

    def free(self, slots: torch.Tensor) -> None:
        """Return slots to the pool; freeing the dump slot or a free slot is an internal error."""
        if slots.numel() == 0:
            return
        slots = slots.to("cpu", torch.int64)
        values = slots.tolist()
        n = len(values)
        assert min(values) > 0, "slot 0 is the dump slot and is never allocated"
        assert len(set(values)) == n, "duplicate slots in one free"
        assert not bool(self._is_free[slots].any()), "double free of a KV slot"
        self._free[self._num_free : self._num_free + n] = slots
        self._num_free += n
        self._is_free[slots] = True

    def sort_free(self) -> None:
        """Put the free list back in a fresh pool's order, so allocations come out as ascending runs
        of slots again instead of the order earlier frees left (which scatters a request's KV over
        the pool). O(num_free log num_free): for idle moments, such as between benchmark runs."""
        self._free[: self._num_free] = self._free[: self._num_free].sort().values

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer_id], self.v_buffers[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new keys and values. loc: [n]; k, v: [n, num_kv_heads, head_dim]."""
        self.k_buffers[layer_id][loc] = k.to(self.dtype)
        self.v_buffers[layer_id][loc] = v.to(self.dtype)
