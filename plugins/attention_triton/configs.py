"""Block sizes, warps and pipeline stages per head dim and device, and the KV-split heuristic.

On CPU (the Triton interpreter) only correctness matters; on CUDA the defaults target Hopper
(H100/H200: 132 SMs, 228 KB shared memory per SM) and stay safe on Ampere.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecodeConfig:
    """block_n: keys per loop step; min_split: fewest keys worth a split of their own.

    On the H200, GQA 32/8, head dim 128, bf16 (bench/attention.py --sweep, 2026-12-03), four
    pipeline stages are what lets the gathered page-size-1 loads reach 90-93% of the copy
    bandwidth; two stages stopped at 71-74%.
    """

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 4
    min_split: int = 128
    merge_num_warps: int = 4


@dataclass(frozen=True)
class ExtendConfig:
    """block_m: queries per program; block_n: keys per loop step."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact products (no TF32); half types ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.lru_cache(maxsize=None)
def decode_config(head_dim: int, device: torch.device, kv_bytes: int = 2) -> DecodeConfig:
    """Launch settings of the split-KV decode (and verify) kernel for K/V elements of `kv_bytes` bytes
    (2: bf16/fp16, 1: an FP8 pool).

    FP8 KV on Hopper keeps 64 keys a step but takes five pipeline stages instead of four. The
    first FP8 sweep (`bench.attention --kv-dtype fp8_e4m3 --sweep`, H200, GQA 32/8, head dim 128,
    2026-12-07, tenth session) found 64 keys x 5 stages best in all four cases: bs 8 x 16k 139 us
    (128 keys x 4 stages, the guess of b30718b: 156 us; bf16's settings: 195 us), bs 1 x 16k 31.0
    (35.8, 43.1), bs 32 x 4k 128.2 (144.2, 166.0), bs 64 x 2k 127.5 (144.5, 165.8); the bs-8 best
    also took 4x the splits, the others the heuristic's. Five stages of 64 x 128 one-byte K and V
    tiles need 80 KB of shared memory. Elsewhere (Ampere, Ada, head dims over 128, the interpreter)
    the settings do not depend on kv_bytes.
    """
    if device.type != "cuda":
        return DecodeConfig(block_n=32, min_split=64, num_stages=1)
    if head_dim > 128:
        return DecodeConfig(block_n=32, num_warps=4, num_stages=2)
    major, minor = torch.cuda.get_device_capability(device)
    if not (major >= 9 or (major, minor) == (8, 0)):  # 4 stages of K and V tiles need ~128 KB of shared memory
        return DecodeConfig(num_stages=2)
    if kv_bytes == 1 and major >= 9:
        return DecodeConfig(num_stages=5)
    return DecodeConfig()


@functools.lru_cache(maxsize=None)
def trigger_next(device: torch.device) -> bool:
    """Whether the decode kernel lets the next kernel launch at its start (programmatic dependent
    launch: a no-op unless that kernel was launched with it, as quant_fp8's GEMMs are on Hopper): an
    NVIDIA GPU of compute capability 9.0 or newer (not ROCm's 9.x) and a Triton with griddepcontrol.
    Only the one-launch decode (merge fused) asks: after the two-launch one comes its merge kernel.
    The next kernel launches only once every program of this one has started, so it never takes an
    SM from a program of this one still waiting."""
    import triton.language as tl

    return (device.type == "cuda" and torch.version.cuda is not None and torch.cuda.get_device_capability(device)[0] >= 9
            and hasattr(tl.extra.cuda, "gdc_launch_dependents"))


@functools.lru_cache(maxsize=None)
def extend_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> ExtendConfig:
    if device.type != "cuda":
        return ExtendConfig(block_m=32, block_n=32, num_warps=4, num_stages=1)
    major, minor = torch.cuda.get_device_capability(device)
    big_smem = major >= 9 or (major, minor) == (8, 0)
    if dtype == torch.float32 or head_dim > 128:
        return ExtendConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    if not big_smem:
        return ExtendConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)
    if head_dim <= 64:
        return ExtendConfig(block_m=128, block_n=64, num_warps=4, num_stages=3)
    return ExtendConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; a small stand-in elsewhere (keeps interpreter grids small)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_kv_splits(
    batch_size: int, num_kv_heads: int, max_kv_len: int, device: torch.device, max_splits: int,
    waves: int = 3, kv_bytes: int = 2,
) -> int:
    """Splits per request so that stage 1 has about `waves` programs per SM.

    Long requests in small batches get many splits; big batches get few, which keeps the
    partial-result traffic (bs * heads * splits * v_dim floats) small next to the KV read. The
    kernel still caps each request at ceil(kv_len / min_split) splits. Three waves is what the
    H200 sweep picked (batch 16 x 4096: 4 splits, batch 64: 1, batch 1: 32); eight over-split.
    kv_bytes: the K/V element size, for the min_split of the launch settings the kernel will take
    (the same for every element size today; an FP8 pool's split count is not tuned separately yet).
    """
    programs = max(batch_size * num_kv_heads, 1)
    wanted = -(-waves * num_sms(device) // programs)
    by_length = -(-max(max_kv_len, 1) // decode_config(0, device, kv_bytes).min_split)
    return max(1, min(wanted, by_length, max_splits))
