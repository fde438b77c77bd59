"""Building the rotary cos/sin cache, with the rope scalings of the Llama family.

Matches transformers' `ROPE_INIT_FUNCTIONS` for "default", "linear" and "llama3" (fp32 arithmetic,
same formulas), so positions rotate exactly as in the Hugging Face model. `shared_cos_sin_cache` gives
every layer of a model the same cache (one [max_position, rotary_dim] tensor per rotary config and
device, not one per layer: 2 GiB saved at an 8B shape with a 128k context).
"""

from __future__ import annotations

import json
import math
import weakref
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_type_of(rope_scaling: dict[str, Any] | None) -> str:
    """The rope type named by a Hugging Face rope_scaling / rope_parameters dict ("default" if none)."""
    if not rope_scaling:
        return "default"
    return rope_scaling.get("rope_type") or rope_scaling.get("type") or "default"


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: keep high frequencies, divide low ones by `factor`, interpolate between."""
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_inv_freq(rotary_dim: int, base: float, rope_scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2] in fp32, after the scaling named by `rope_scaling`."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (base**exponents)
    rope_type = rope_type_of(rope_scaling)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    raise ValueError(
        f"rope_scaling: unsupported rope type {rope_type!r}; expected one of: "
        f"{', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def build_cos_sin_cache(
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict[str, Any] | None = None,
) -> torch.Tensor:
    """The cache `rotary_embedding` reads: [max_position, rotary_dim] fp32 on the CPU.

    Row p holds cos(p * inv_freq) in its first rotary_dim // 2 entries and sin(p * inv_freq) in
    the rest.
    """
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim: expected an even number, got {rotary_dim}")
    inv_freq = rope_inv_freq(rotary_dim, base, rope_scaling)  # [rotary_dim // 2]
    t = torch.arange(max_position, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)  # [max_position, rotary_dim // 2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


# (rotary_dim, max_position, base, scaling as JSON, device) -> the cache; an entry lives as long as a
# layer holds its tensor, so a dropped model frees its cache.
_SHARED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def shared_cos_sin_cache(rotary_dim: int, max_position: int, base: float,
                         rope_scaling: dict[str, Any] | None, device: torch.device | str) -> torch.Tensor:
    """`build_cos_sin_cache` on `device`, built once and shared while any layer holds it (read only)."""
    device = torch.device(device)
    key = (rotary_dim, max_position, float(base), json.dumps(rope_scaling, sort_keys=True, default=str), str(device))
    cache = _SHARED.get(key)
    if cache is None:
        cache = build_cos_sin_cache(rotary_dim, max_position, base, rope_scaling).to(device)
        _SHARED[key] = cache
    return cache
