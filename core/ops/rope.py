"""Building the rotary cos/sin cache, with the rope scalings of the Llama and Phi-3 families.

Matches transformers' `ROPE_INIT_FUNCTIONS` for "default", "linear", "llama3", "longrope", "yarn"
and "dynamic" (fp32 arithmetic, same formulas), so positions rotate exactly as in the Hugging Face
model. The cache is built once for a context of `max_position` tokens, so the kinds that transformers
recomputes per forward are fixed by that context: "longrope" takes its long factors when the context
exceeds `original_max_position_embeddings` and its short ones otherwise (transformers switches per
forward on the sequence's length; cached keys cannot be re-rotated), and "dynamic" NTK scaling, which
only grows the base past `max_position_embeddings`, is the default within it (the models build the
cache for exactly `max_position_embeddings`, so no position reaches past it). "yarn" is static in
transformers too: one set of frequencies and one attention factor for every position. `shared_cos_sin_cache` gives
every layer of a model the same cache (one [max_position, rotary_dim] tensor per rotary config and
device, not one per layer: 2 GiB saved at an 8B shape with a 128k context).
"""

from __future__ import annotations

import json
import math
import weakref
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn", "dynamic")


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


def _original_max(params: dict[str, Any], rope_type: str) -> int:
    original = params.get("original_max_position_embeddings")
    if not original:
        raise ValueError(f"rope_scaling: expected 'original_max_position_embeddings' for {rope_type}, got {params}")
    return int(original)


def _longrope_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any], max_position: int) -> torch.Tensor:
    """Phi-3 LongRoPE: divide each frequency by its long factor when the context `max_position`
    exceeds the original one, else by its short factor."""
    which = "long_factor" if max_position > _original_max(params, "longrope") else "short_factor"
    factors = params.get(which)
    if not isinstance(factors, (list, tuple)) or len(factors) != inv_freq.numel():
        raise ValueError(f"rope_scaling {which}: expected a list of {inv_freq.numel()} numbers (rotary_dim // 2), "
                         f"got {factors!r}")
    return inv_freq / torch.tensor(factors, dtype=torch.float32)


def _yarn_factor(params: dict[str, Any], max_position: int | None) -> float:
    """YaRN's `factor`; None (DeepSeek-V3 style) is the context over the original one, as in transformers."""
    factor = params.get("factor")
    if factor is None:
        if max_position is None:
            raise ValueError("max_position: expected the context length for rope type 'yarn' without 'factor', got None")
        return max_position / _original_max(params, "yarn")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
        raise ValueError(f"rope_scaling factor: expected a positive number for yarn, got {factor!r}")
    return float(factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude scale (the paper's eq. 21): 0.1 * mscale * ln(scale) + 1, 1.0 when scale <= 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(rotary_dim: int, base: float, params: dict[str, Any], max_position: int | None) -> torch.Tensor:
    """YaRN (NTK-by-parts): frequencies that turn fewer than `beta_slow` times over the original context
    are divided by `factor` (interpolated), those turning more than `beta_fast` times are kept
    (extrapolated), with a linear ramp over the dims between."""
    factor = _yarn_factor(params, max_position)
    original = _original_max(params, "yarn")
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:  # the dim whose wavelength fits num_rotations times
        return rotary_dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # NOTE: transformers' guard against a zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim)
    extrapolation = 1 - ramp  # 1: keep the frequency, 0: divide it by factor
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _yarn_attention_factor(params: dict[str, Any], max_position: int | None) -> float:
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = _yarn_factor(params, max_position)
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:  # DeepSeek: the ratio; its mscale_all_dim softmax scale is the model's
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor)


def rope_attention_factor(rope_scaling: dict[str, Any] | None, max_position: int) -> float:
    """The factor cos and sin are multiplied by: `attention_factor` when given; for longrope else
    sqrt(1 + ln(s) / ln(original_max_position_embeddings)) with s = `factor` or max_position / original
    (1.0 when s <= 1); for yarn else 0.1 * ln(factor) + 1, or with `mscale` and `mscale_all_dim` both
    set the ratio mscale(factor, mscale) / mscale(factor, mscale_all_dim) (1.0 for factor <= 1);
    1.0 for the other kinds."""
    rope_type = rope_type_of(rope_scaling)
    if rope_type == "yarn":
        return _yarn_attention_factor(rope_scaling, max_position)
    if rope_type != "longrope":
        return 1.0
    if rope_scaling.get("attention_factor") is not None:
        return float(rope_scaling["attention_factor"])
    original = _original_max(rope_scaling, "longrope")
    scale = rope_scaling.get("factor") or max_position / original
    return 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(original))


def rope_inv_freq(rotary_dim: int, base: float, rope_scaling: dict[str, Any] | None = None,
                  max_position: int | None = None) -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2] in fp32, after the scaling named by `rope_scaling`.

    max_position: the context the cache serves; "longrope" needs it to choose its factors, "yarn"
    without a `factor` takes max_position / original_max_position_embeddings.
    """
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (base**exponents)
    rope_type = rope_type_of(rope_scaling)
    if rope_type in ("default", "dynamic"):
        return inv_freq
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    if rope_type == "yarn":
        return _yarn_inv_freq(rotary_dim, base, rope_scaling, max_position)
    if rope_type == "longrope":
        if max_position is None:
            raise ValueError("max_position: expected the context length for rope type 'longrope', got None")
        return _longrope_inv_freq(inv_freq, rope_scaling, max_position)
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

    Row p holds a * cos(p * inv_freq) in its first rotary_dim // 2 entries and a * sin(p * inv_freq)
    in the rest, a the scaling's attention factor (1.0 but for longrope and yarn).
    """
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim: expected an even number, got {rotary_dim}")
    inv_freq = rope_inv_freq(rotary_dim, base, rope_scaling, max_position)  # [rotary_dim // 2]
    t = torch.arange(max_position, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)  # [max_position, rotary_dim // 2]
    factor = rope_attention_factor(rope_scaling, max_position)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    return cache if factor == 1.0 else cache * factor


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
