"""What a model runner runs on, resolved from EngineArgs before anything is allocated: the device
and dtype, where the model comes from and its context length, the memory still free, and the
request and KV pools sized to fit it.

Each is a plain function of the settings, so the engine and the CLI resolve the same things the
same way (backplane.executor.model_runner re-exports them under their old import path)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from backplane.config import PoolConfig
from backplane.contracts.attention import AttentionLayerInfo
from backplane.contracts.memory import ReqToTokenPool, TokenToKVPool, kv_cache_storage_dtype
from backplane.executor.kv_scales import KVCacheScales
from backplane.layers.parallel import ParallelContext
from backplane.settings import EngineArgs

logger = logging.getLogger(__name__)

CPU_KV_BUDGET_BYTES = 2 << 30
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(args: EngineArgs) -> torch.device:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available on this machine; use --device cpu or auto")
    if args.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(args.device)


def resolve_dtype(args: EngineArgs, device: torch.device) -> torch.dtype:
    if args.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[args.dtype]


def dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, value in _DTYPES.items() if value is dtype)


@dataclass
class ModelSource:
    """Where the model comes from: a preset (dummy weights) or a local Hugging Face directory."""

    hf_config: Any
    load_format: str
    path: Path | None


def resolve_model_source(args: EngineArgs) -> ModelSource:
    from backplane.models.loader import load_hf_config
    from backplane.models.presets import PRESETS, get_preset

    path = Path(args.model).expanduser()
    if path.is_dir():
        load_format = "safetensors" if args.load_format == "auto" else args.load_format
        return ModelSource(load_hf_config(path), load_format, path)
    if args.model in PRESETS:
        if args.load_format == "safetensors":
            raise ValueError(f"--model {args.model}: a preset has no weight files; use --load-format dummy or auto")
        return ModelSource(get_preset(args.model), "dummy", None)
    raise ValueError(
        f"--model {args.model!r}: expected a local Hugging Face model directory or a preset name; "
        f"presets: {', '.join(sorted(PRESETS))}"
    )


def context_length(args: EngineArgs, hf_config: Any) -> int:
    """--context-length, or the model's max_position_embeddings; never beyond it (positions past
    it have no rotary embedding)."""
    limit = int(hf_config.max_position_embeddings)
    if args.context_length is not None and args.context_length > limit:
        raise ValueError(f"--context-length {args.context_length}: expected at most the model's "
                         f"max_position_embeddings {limit}; positions past it have no rotary embedding")
    return args.context_length or limit


def available_memory(device: torch.device) -> int:
    """Bytes that can still be allocated on `device`: free device memory, or the host's available RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_pool_memory(device: torch.device, pools: list[tuple[str, int, int, str]]) -> None:
    """Refuse pools that cannot be allocated: (flag, value, bytes, what) each, against free memory."""
    free = available_memory(device)
    for flag, value, size, what in pools:
        if size > free:
            most = max(value * free // max(size, 1), 0)
            raise ValueError(f"{flag} {value}: {value} {what} need {_gib(size)} of {device.type} memory but "
                             f"{_gib(free)} is free; expected at most about {most}")


def _gib(size: int) -> str:
    return f"{size / 2**30:,.1f} GiB"


# -- the pools ----------------------------------------------------------------------------------


def build_pools(args: EngineArgs, pool: PoolConfig, layers: list[AttentionLayerInfo], *, context_len: int,
                device: torch.device, dtype: torch.dtype, parallel: ParallelContext,
                kv_scales: KVCacheScales | None = None) -> tuple[ReqToTokenPool, TokenToKVPool]:
    """The request pool (`pool.req_rows` rows, one more for graph padding) and the KV pool for
    `layers`, sized by --max-total-tokens or by the memory left after the weights; both refused
    in one line when they cannot be allocated.

    The KV pool holds `dtype` under --kv-cache-dtype auto, float8_e4m3fn under fp8_e4m3 (half the
    bytes a token of bf16, so twice the tokens in the same memory), with the checkpoint's
    `kv_scales` (1.0 for the layers it has none for)."""
    info = layers[0]
    kv_dtype = kv_cache_storage_dtype(args.kv_cache_dtype, dtype)
    per_token = TokenToKVPool.bytes_per_token(len(layers), info.num_kv_heads, info.head_dim, kv_dtype)
    num_slots = kv_pool_slots(args, per_token, device, parallel)
    req_rows = pool.req_rows
    max_ctx = min(context_len, num_slots) + pool.spec_room  # + a verify's draft tokens
    check_pool_memory(device, [
        ("--max-total-tokens", num_slots, num_slots * per_token, "KV tokens"),
        ("--max-running-requests", req_rows, (req_rows + 1) * max_ctx * 4, "request rows"),
    ])
    req_pool = ReqToTokenPool(req_rows + 1, max_ctx, device)  # + one row for graph padding
    kv_pool = TokenToKVPool(num_slots, len(layers), info.num_kv_heads, info.head_dim, kv_dtype, device)
    if kv_scales:
        kv_scales.apply(kv_pool)
    elif kv_pool.is_fp8:
        logger.warning("--kv-cache-dtype %s: the checkpoint has no k_scale/v_scale; every layer uses 1.0, "
                       "which may cost accuracy", args.kv_cache_dtype)
    logger.info("KV pool: %d tokens of %s (%.1f MB), %d request rows", num_slots, kv_dtype,
                num_slots * per_token / 2**20, req_rows)
    return req_pool, kv_pool


def kv_pool_slots(args: EngineArgs, per_token: int, device: torch.device, parallel: ParallelContext) -> int:
    """--max-total-tokens, or as many slots of `per_token` bytes as --mem-fraction-static leaves
    (on CPU, a fixed budget); at least 2, since slot 0 is the padding slot."""
    num_slots = args.max_total_tokens or _profile_num_slots(args, per_token, device, parallel)
    if num_slots < 2:
        if args.max_total_tokens:
            raise ValueError(f"--max-total-tokens {num_slots}: expected at least 2 (slot 0 of the KV pool "
                             "is the padding slot, so 1 leaves no room for any token)")
        raise ValueError(
            f"--mem-fraction-static {args.mem_fraction_static}: leaves room for {num_slots} KV "
            "tokens after the weights; raise it or pass --max-total-tokens"
        )
    return num_slots


def _profile_num_slots(args: EngineArgs, per_token: int, device: torch.device, parallel: ParallelContext) -> int:
    if device.type != "cuda":
        return max(2, min(CPU_KV_BUDGET_BYTES // per_token, 1 << 17))
    free, total = torch.cuda.mem_get_info(device)
    budget = total * args.mem_fraction_static - (total - free)
    # Rank 0 allocates slots for every rank: all pools get the size of the smallest.
    return parallel.min_over_ranks(int(budget // per_token))
