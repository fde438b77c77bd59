"""KV-cache memory: the request-to-token map and the per-layer K/V token pool.

The token pool has page size 1: one slot holds one token's K and V for every layer. Slot 0 is never
handed out; CUDA-graph padding points its dummy tokens there, so whatever they write is harmless.

FP8 KV cache (--kv-cache-dtype fp8_e4m3): the pool stores float8_e4m3fn with one scale per layer
for K and one for V (per tensor, fixed once the pool is built). A value x is stored as
saturate(x / scale) and read back as stored * scale; `quantize_fp8` and `dequantize_kv` are the
two halves, and every backend's view of the cache must equal them.
"""

from __future__ import annotations

import math

import torch

FP8_E4M3 = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0  # the largest finite float8_e4m3fn; larger magnitudes saturate to it
KV_CACHE_DTYPES = {"fp8_e4m3": FP8_E4M3}  # --kv-cache-dtype values other than "auto"


def kv_cache_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's element dtype for --kv-cache-dtype: the model's under "auto", else the FP8 type."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype!r}: expected one of auto, {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[kv_cache_dtype]


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale in float8_e4m3fn (computed in fp32, rounded to nearest even), saturated to +-448.

    With a scale of 1.0 (the default of --kv-cache-dtype fp8_e4m3) a bf16 or fp16 x is clamped and
    converted as it is: 448 is exact in both, and the cast rounds the value itself, so the result is
    the fp32 path's bit for bit in two launches instead of four (the pool runs this for K and for V
    in every layer of every step)."""
    if scale == 1.0 and x.dtype in (torch.bfloat16, torch.float16):
        return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_E4M3)
    return (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_E4M3)


def dequantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What a pool element means: an FP8 one times its scale (in fp32); any other dtype as is."""
    if x.dtype != FP8_E4M3:
        return x
    return x.float() * scale


def check_kv_scale(scale: float, what: str) -> float:
    """`scale` as a float when it is finite and positive, else a ValueError naming `what`."""
    value = float(scale)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{what}: expected a finite positive KV cache scale, got {value}")
    return value


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
    """Per-layer K and V buffers of shape [num_slots + 1, num_kv_heads, head_dim]; slot 0 is the dump slot.

    dtype: the element dtype; float8_e4m3fn makes an FP8 pool, whose layer l stores K / k_scales[l]
    and V / v_scales[l] (1.0 until `set_kv_scales`; a pool of any other dtype always reports 1.0).
    """

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
        self.k_scales = [1.0] * num_layers
        self.v_scales = [1.0] * num_layers

    @property
    def is_fp8(self) -> bool:
        return self.dtype == FP8_E4M3

    def set_kv_scales(self, layer_id: int, k_scale: float, v_scale: float) -> None:
        """Set layer `layer_id`'s K and V scales (from the checkpoint). Set them before anything is
        written and before graphs are captured: backends read them as constants of each launch."""
        if not 0 <= layer_id < self.num_layers:
            raise ValueError(f"KV cache scales: layer {layer_id} out of range; the pool has {self.num_layers} layers")
        self.k_scales[layer_id] = check_kv_scale(k_scale, f"layer {layer_id} k_scale")
        self.v_scales[layer_id] = check_kv_scale(v_scale, f"layer {layer_id} v_scale")

    def kv_scales(self, layer_id: int) -> tuple[float, float]:
        """(k_scale, v_scale) of a layer: what its stored elements are multiplied by (1.0 unless FP8)."""
        if not self.is_fp8:
            return 1.0, 1.0
        return self.k_scales[layer_id], self.v_scales[layer_id]

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
        """The layer's K and V buffers as stored (FP8 ones: multiply by `kv_scales`, see `dequantize_kv`)."""
        return self.k_buffers[layer_id], self.v_buffers[layer_id]

    def quantize_kv(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v as this pool stores them for `layer_id`: an FP8 pool's `quantize_fp8` with the layer's
        scales; any other pool's dtype."""
        if not self.is_fp8:
            return k.to(self.dtype), v.to(self.dtype)
        k_scale, v_scale = self.kv_scales(layer_id)
        return quantize_fp8(k, k_scale), quantize_fp8(v, v_scale)

    def round_trip(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What reading k, v back from this pool gives, in k's and v's dtype: for an FP8 pool the new
        tokens as the cached ones are seen (quantized, then dequantized with the layer's scales)."""
        k_stored, v_stored = self.quantize_kv(layer_id, k, v)
        k_scale, v_scale = self.kv_scales(layer_id)
        return dequantize_kv(k_stored, k_scale).to(k.dtype), dequantize_kv(v_stored, v_scale).to(v.dtype)

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new keys and values. loc: [n]; k, v: [n, num_kv_heads, head_dim], quantized by
        `quantize_kv` unless already in the pool's dtype (an FP8 pool: quantized with this layer's scales)."""
        if k.dtype != self.dtype or v.dtype != self.dtype:
            k, v = self.quantize_kv(layer_id, k, v)
        self.k_buffers[layer_id][loc] = k
        self.v_buffers[layer_id][loc] = v
