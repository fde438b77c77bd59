"""Loading PEFT LoRA adapters from a directory, validated against the model they will run on.

A PEFT adapter directory holds `adapter_config.json` (r, lora_alpha, target_modules, use_rslora,
...) and `adapter_model.safetensors` with, per targeted projection of layer i, tensors named like
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` ([r, in_features]) and
`...lora_B.weight` ([out_features, r]). The delta a projection gains is
`scaling * x A^T B^T` with scaling = lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora.

Everything that would make the adapter run wrongly is refused with an error naming the adapter
and the file: missing files, a rank above `--max-lora-rank`, a target the model does not have,
non-float or non-finite (NaN, infinite) weights, a corrupt weights file, wrong shapes, a file with no
LoRA tensors, a lora_alpha so large that the delta overflows, and PEFT features this executor does not
implement (aLoRA's `alora_invocation_tokens` among them: PEFT applies such an adapter only from the
invocation tokens on, which this executor does not do). An empty list or dict of an unsupported
option (`modules_to_save: []`) means the option is off.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The Hugging Face projection names LoRA may target in the Llama family.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")
# MoE expert weights, which no LoRA wrapper serves: Mixtral's experts (block_sparse_moe.experts.N.w1/w2/w3),
# Qwen-MoE's (mlp.experts.N.gate_proj, ...) and Qwen2-MoE's shared expert (mlp.shared_expert.gate_proj, ...).
EXPERT_PROJECTIONS = ("w1", "w2", "w3")
_EXPERT_KEY = re.compile(r"layers\.(\d+)\.\w+\.(experts\.\d+|shared_expert)\.(\w+)\.lora_[AB]")
_NO_EXPERT_LORA = ("LoRA on MoE experts is not supported; expected adapters of the attention projections "
                   "(q_proj, k_proj, v_proj, o_proj) or of dense MLP layers")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# PEFT options that change the arithmetic and are not implemented: (key, value meaning "off").
_UNSUPPORTED = (("use_dora", False), ("rank_pattern", {}), ("alpha_pattern", {}), ("bias", "none"),
                ("lora_bias", False), ("modules_to_save", None), ("fan_in_fan_out", False),
                ("alora_invocation_tokens", None))
# The largest entry |scaling * B A| may reach (bounded by scaling * max|B| * max|A| * rank). Trained
# adapters stay far below 1; a bound this far above them only catches a lora_alpha that overflows.
MAX_DELTA = 1e4


class AdapterError(ValueError):
    """An adapter directory that cannot be served; the message names the adapter and the file."""


@dataclass(frozen=True)
class ProjectionShape:
    """A projection's full (unsharded) input and output features."""

    in_features: int
    out_features: int


@dataclass(frozen=True)
class AdapterConfig:
    """What adapter_config.json says, validated."""

    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


@dataclass
class LoraAdapter:
    """One loaded adapter, on the host in the model dtype.

    weights: (layer index, projection name) -> (A [rank, in_features], B [out_features, rank]).
    """

    name: str
    path: Path
    config: AdapterConfig
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def rank(self) -> int:
        return self.config.rank

    @property
    def scaling(self) -> float:
        return self.config.scaling


def read_adapter_config(name: str, path: str | Path) -> AdapterConfig:
    """Parse and check `path`/adapter_config.json of adapter `name`."""
    file = _require_file(name, Path(path), CONFIG_FILE)
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterError(f"LoRA adapter {name!r} ({file}): expected JSON, got a parse error: {exc}") from exc
    where = f"LoRA adapter {name!r} ({file})"
    if not isinstance(raw, dict):
        raise AdapterError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    if raw.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where}: expected peft_type 'LORA', got {raw.get('peft_type')!r}")
    for key, off in _UNSUPPORTED:
        value = raw.get(key, off)
        if value is not None and value != off and value not in ([], {}):
            raise AdapterError(f"{where}: {key}={value!r} is not supported; expected {off!r}")
    rank = raw.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"{where}: expected r (the rank) to be an integer >= 1, got {rank!r}")
    alpha = raw.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise AdapterError(f"{where}: expected lora_alpha to be a finite number, got {alpha!r}")
    rslora = raw.get("use_rslora", False)
    if not isinstance(rslora, bool) and rslora is not None:
        raise AdapterError(f"{where}: expected use_rslora to be true or false, got {rslora!r}")
    targets = _target_modules(raw.get("target_modules"), where)
    return AdapterConfig(rank, float(alpha), bool(rslora), targets)


def _target_modules(value, where: str) -> tuple[str, ...]:
    if value == "all-linear":
        return PROJECTIONS
    if isinstance(value, str):
        value = [value]  # a single name (PEFT would also read it as a regex; a plain name is the same)
    if not isinstance(value, list) or not value:
        raise AdapterError(f"{where}: expected target_modules to be a non-empty list of names, got {value!r}")
    names = tuple(dict.fromkeys(str(v).rsplit(".", 1)[-1] for v in value))
    unknown = [n for n in names if n not in PROJECTIONS]
    experts = [n for n in unknown if n in EXPERT_PROJECTIONS]
    if experts:
        raise AdapterError(f"{where}: target module {experts[0]!r} is a MoE expert projection "
                           f"(block_sparse_moe.experts.N.{experts[0]}); {_NO_EXPERT_LORA}")
    if unknown:
        raise AdapterError(
            f"{where}: target module {unknown[0]!r} is not a projection this model has LoRA support for; "
            f"expected some of {', '.join(PROJECTIONS)}"
        )
    return names


def load_adapter(
    name: str,
    path: str | Path,
    shapes: dict[str, ProjectionShape],
    num_layers: int,
    max_rank: int,
    dtype: torch.dtype,
) -> LoraAdapter:
    """Read, validate and return adapter `name` from directory `path`.

    shapes: the model's projections (PROJECTIONS names) with their full sizes; max_rank: the
    configured --max-lora-rank; dtype: the model dtype the weights are converted to.
    """
    config = read_adapter_config(name, path)
    if config.rank > max_rank:
        raise AdapterError(
            f"LoRA adapter {name!r} ({Path(path) / CONFIG_FILE}): rank r={config.rank} is above "
            f"--max-lora-rank {max_rank}; raise --max-lora-rank to at least {config.rank}"
        )
    missing = [t for t in config.target_modules if t not in shapes]
    if missing:
        raise AdapterError(
            f"LoRA adapter {name!r} ({Path(path) / CONFIG_FILE}): target module {missing[0]!r} does not exist "
            f"in this model; it has {', '.join(shapes)}"
        )
    file = _require_file(name, Path(path), WEIGHTS_FILE)
    tensors = _read_weights(name, file)
    if not tensors:
        raise AdapterError(f"LoRA adapter {name!r} ({file}): expected lora_A/lora_B weights of "
                           f"{', '.join(config.target_modules)}, got a file with no tensors")
    pairs = _pair_tensors(name, file, tensors, config, num_layers)
    weights = {key: _checked_pair(name, file, key, a, b, config.rank, shapes[key[1]], dtype)
               for key, (a, b) in pairs.items()}
    _check_delta_bound(name, Path(path) / CONFIG_FILE, config, weights)
    return LoraAdapter(name, Path(path), config, weights)


def _check_delta_bound(name: str, file: Path, config: AdapterConfig, weights) -> None:
    """Refuse a scaling (lora_alpha / r) that makes the delta weights overflow: NaN output otherwise."""
    bound = max(float(a.abs().max()) * float(b.abs().max()) for a, b in weights.values()) * config.rank
    delta = abs(config.scaling) * bound
    if not math.isfinite(delta) or delta > MAX_DELTA:
        raise AdapterError(f"LoRA adapter {name!r} ({file}): lora_alpha={config.alpha:g} gives scaling "
                           f"{config.scaling:g} and delta weights up to {delta:.3g}; expected at most {MAX_DELTA:g} "
                           "(a smaller lora_alpha)")


def _require_file(name: str, directory: Path, filename: str) -> Path:
    if not directory.is_dir():
        raise AdapterError(f"LoRA adapter {name!r}: expected a PEFT adapter directory, got {str(directory)!r}")
    file = directory / filename
    if not file.is_file():
        hint = " (save it with save_pretrained(..., safe_serialization=True))" if filename == WEIGHTS_FILE else ""
        raise AdapterError(f"LoRA adapter {name!r}: expected file {file} to exist, but it is missing{hint}")
    return file


def _read_weights(name: str, file: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as exc:  # truncated, not safetensors, bad header
        raise AdapterError(f"LoRA adapter {name!r} ({file}): expected a safetensors file, it is corrupt or "
                           f"unreadable: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _pair_tensors(name, file, tensors, config: AdapterConfig, num_layers: int):
    """Group the file's tensors into {(layer, projection): (A, B)}, refusing anything else."""
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        expert = _EXPERT_KEY.search(key)
        if expert is not None:
            raise AdapterError(f"LoRA adapter {name!r} ({file}): tensor {key!r} adapts the {expert.group(2)}.{expert.group(3)} "
                               f"of MoE layer {expert.group(1)}; {_NO_EXPERT_LORA}")
        match = _KEY.search(key)
        if match is None or match.group(2) not in config.target_modules:
            raise AdapterError(
                f"LoRA adapter {name!r} ({file}): unexpected tensor {key!r}; expected lora_A/lora_B weights of "
                f"the target modules {', '.join(config.target_modules)} in layers 0..{num_layers - 1}"
            )
        layer = int(match.group(1))
        if layer >= num_layers:
            raise AdapterError(
                f"LoRA adapter {name!r} ({file}): tensor {key!r} is for layer {layer}, "
                f"but the model has {num_layers} layers"
            )
        parts.setdefault((layer, match.group(2)), {})[match.group(3)] = tensor
    for (layer, proj), ab in parts.items():
        if set(ab) != {"A", "B"}:
            absent = "lora_B" if "A" in ab else "lora_A"
            raise AdapterError(f"LoRA adapter {name!r} ({file}): layer {layer} {proj} has no {absent} weight")
    return {key: (ab["A"], ab["B"]) for key, ab in parts.items()}


def _checked_pair(name, file, key, a, b, rank: int, shape: ProjectionShape, dtype: torch.dtype):
    layer, proj = key
    where = f"LoRA adapter {name!r} ({file}), layer {layer} {proj}"
    for tensor, label in ((a, "lora_A"), (b, "lora_B")):
        if tensor.dtype not in _FLOAT_DTYPES:
            raise AdapterError(f"{where}: expected floating-point {label} weights, got {tensor.dtype}")
    expected_a, expected_b = (rank, shape.in_features), (shape.out_features, rank)
    if tuple(a.shape) != expected_a or tuple(b.shape) != expected_b:
        raise AdapterError(
            f"{where}: expected lora_A {list(expected_a)} and lora_B {list(expected_b)}, "
            f"got {list(a.shape)} and {list(b.shape)}"
        )
    a, b = a.to(dtype).contiguous(), b.to(dtype).contiguous()
    for tensor, label in ((a, "lora_A"), (b, "lora_B")):  # checked in the model dtype: fp16 overflow is inf
        if not bool(torch.isfinite(tensor).all()):
            raise AdapterError(f"{where}: {label} holds NaN or infinite values (in {dtype}); expected finite weights")
    return a, b
