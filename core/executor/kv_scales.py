"""The FP8 KV cache's per-tensor scales, read from a checkpoint while its weights load.

Checkpoints quantized with an FP8 KV cache (compressed-tensors' `kv_cache_scheme`, ModelOpt,
Quark) carry one K and one V scale per attention layer under one of these names (layer i):

    model.layers.i.self_attn.k_scale / v_scale              compressed-tensors (llm-compressor)
    model.layers.i.self_attn.attn.k_scale / v_scale         vLLM's own naming
    model.layers.i.self_attn.k_proj.output_scale / v_proj   older compressed-tensors, Quark
    model.layers.i.self_attn.k_proj.k_scale / v_proj.v_scale  ModelOpt
    model.layers.i.self_attn.kv_scale                       AutoFP8 (one scale for both)

A query scale (`q_scale`, `q_proj.output_scale`) is read and ignored: queries stay in the model
dtype. Layers without scales keep 1.0, as vLLM does. The weight loader offers every checkpoint
tensor to `KVCacheScales.offer` before looking for a parameter; `apply` sets them on the pool.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from backplane.contracts.memory import TokenToKVPool, check_kv_scale

logger = logging.getLogger(__name__)

_SCALE_NAME = re.compile(
    r"(?:^|\.)layers\.(?P<layer>\d+)\.self_attn\."
    r"(?:(?:attn\.)?(?P<which>[qkv]|kv)_scale|(?P<proj>[qkv])_proj\.(?:output_scale|(?P=proj)_scale))$"
)


def kv_scale_target(name: str) -> tuple[int, str] | None:
    """(layer index, "k" | "v" | "kv" | "q") when `name` is an attention layer's cache scale, else None."""
    match = _SCALE_NAME.search(name)
    if match is None:
        return None
    return int(match["layer"]), match["which"] or match["proj"]


def checkpoint_kv_cache_dtype(quantization_config: dict[str, Any] | None, source: str) -> str | None:
    """The KV cache dtype a checkpoint's `quantization_config` was calibrated for: "fp8_e4m3" for a
    compressed-tensors `kv_cache_scheme` of per-tensor 8-bit floats, None when it has none. Any other
    scheme is refused in one line naming `source` (the config file)."""
    scheme = (quantization_config or {}).get("kv_cache_scheme")
    if not scheme:
        return None
    got = {key: scheme.get(key) for key in ("type", "num_bits", "strategy", "dynamic")}
    if got["type"] == "float" and got["num_bits"] == 8 and got["strategy"] in (None, "tensor") and not got["dynamic"]:
        return "fp8_e4m3"
    raise ValueError(f"{source}: quantization_config.kv_cache_scheme {got}: expected static per-tensor FP8 "
                     "(type float, num_bits 8, strategy tensor, dynamic false); the only KV cache scheme "
                     "backplane serves")


@dataclass
class KVCacheScales:
    """The K and V scale of each layer found so far (a "kv" scale counts for both)."""

    k: dict[int, float] = field(default_factory=dict)
    v: dict[int, float] = field(default_factory=dict)

    def offer(self, name: str, tensor: torch.Tensor, file: str = "checkpoint") -> bool:
        """Take `tensor` if `name` is a KV cache scale (True: the loader must not look for a
        parameter); a scale with more than one element is refused naming the file and the tensor."""
        target = kv_scale_target(name)
        if target is None:
            return False
        layer, which = target
        if tensor.numel() != 1:
            raise ValueError(f"{file}: tensor {name}: expected one per-tensor KV cache scale, got shape "
                             f"{list(tensor.shape)}; per-head or per-token KV scales are not supported")
        if which == "q":
            return True  # queries are not quantized
        value = check_kv_scale(tensor.float().item(), f"{file}: tensor {name}")
        if which in ("k", "kv"):
            self.k[layer] = value
        if which in ("v", "kv"):
            self.v[layer] = value
        return True

    def __bool__(self) -> bool:
        return bool(self.k or self.v)

    def apply(self, pool: TokenToKVPool) -> None:
        """Set the found scales on an FP8 pool (other layers keep 1.0); a pool of the model's dtype
        ignores them. A scale for a layer the pool does not have is refused."""
        layers = sorted(set(self.k) | set(self.v))
        if layers and layers[-1] >= pool.num_layers:
            raise ValueError(f"KV cache scales: the checkpoint has scales for layer {layers[-1]} but the model "
                             f"has {pool.num_layers} attention layers")
        if not pool.is_fp8:
            if layers:
                logger.info("KV cache scales of %d layers in the checkpoint are unused: the KV cache is %s "
                            "(pass --kv-cache-dtype fp8_e4m3 to use them)", len(layers), pool.dtype)
            return
        for layer in layers:
            pool.set_kv_scales(layer, self.k.get(layer, 1.0), self.v.get(layer, 1.0))
