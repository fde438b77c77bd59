"""Loading a local Hugging Face model directory: config, safetensors weights, the model class."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator

import torch

from backplane.models.config_check import read_config_json
from backplane.models.config_utils import reset_ignored_keys

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
HF_QUANT_CONFIG = "hf_quant_config.json"  # NVIDIA ModelOpt's older exports keep their quantization here


def load_hf_config(path: str | os.PathLike):
    """transformers' config of the local model directory `path`, with clear errors when absent. A
    config.json without quantization_config takes NVIDIA ModelOpt's hf_quant_config.json beside it."""
    from transformers import AutoConfig

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model path {path!r}: expected a local Hugging Face model directory, "
                                "but it does not exist (or use --load-format dummy with a preset name)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"model path {path!r}: expected a config.json in it, found none")
    read_config_json(Path(path) / "config.json")  # a bad field is one line here, not an error deep inside
    file = os.path.join(path, "config.json")
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - an unknown model_type, a field transformers' own checks refuse
        raise ValueError(f"model config '{file}': transformers cannot read it: {one_line(exc)}") from None
    ignored = reset_ignored_keys(config)
    if ignored:
        logger.warning("model config '%s': %s ignores %s in transformers, and so does backplane", file,
                       config.architectures[0], ", ".join(f"{k}={v!r}" for k, v in ignored.items()))
    if getattr(config, "quantization_config", None) is None:
        modelopt = _modelopt_quant_config(Path(path) / HF_QUANT_CONFIG)
        if modelopt is not None:
            config.quantization_config = modelopt
    return config


def _modelopt_quant_config(file: Path) -> dict[str, Any] | None:
    """An hf_quant_config.json ({"producer": ..., "quantization": {"quant_algo": ...}}, written by
    NVIDIA ModelOpt beside a config.json without quantization_config) as that quantization_config:
    its contents with quant_method "modelopt". None when there is no such file."""
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"'{file}': cannot read it as JSON: {one_line(exc)}") from None
    if not isinstance(data, dict) or not isinstance(data.get("quantization"), dict):
        raise ValueError(f"'{file}': expected a JSON object with a \"quantization\" object (NVIDIA ModelOpt's "
                         f"quant_algo, exclude_modules), got {_short(data)}")
    return {"quant_method": "modelopt", **data}


def one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception's message on one line (its lines joined), at most `limit` characters."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def safetensors_files(path: str | os.PathLike) -> list[str]:
    """The weight files of `path`: the shards named by model.safetensors.index.json, or model.safetensors."""
    path = os.fspath(path)
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        weight_map = _read_weight_map(index)
        files = [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
    elif os.path.isfile(os.path.join(path, SINGLE_FILE)):
        files = [os.path.join(path, SINGLE_FILE)]
    else:
        raise FileNotFoundError(f"model path {path!r}: expected {SINGLE_FILE} or {INDEX_FILE}, found neither")
    for file in files:
        if not os.path.isfile(file):
            raise FileNotFoundError(f"safetensors shard {file!r} named in {INDEX_FILE} is missing")
    return files


def _read_weight_map(index: str) -> dict[str, str]:
    """The index's weight_map (tensor name -> shard file name), checked."""
    try:
        with open(index) as f:
            doc = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"safetensors index {index!r} is corrupt: expected JSON, got a parse error: {e}") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"safetensors index {index!r}: expected a JSON object with a non-empty 'weight_map' "
                         f"object (tensor name -> shard file), got {_short(weight_map if isinstance(doc, dict) else doc)}")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard or os.path.basename(shard) != shard:
            raise ValueError(f"safetensors index {index!r}: weight_map[{name!r}] = {_short(shard)}: expected the "
                             "file name of a shard in the model directory")
    return weight_map


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_checkpoint_shapes(files: list[str], expected: dict[str, tuple[int, ...]]) -> None:
    """Compare every tensor's shape in the files' headers with `expected` (name -> full shape),
    before any tensor is read; ValueError naming the file, the tensor and both shapes."""
    from safetensors import SafetensorError, safe_open

    for file in files:
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        except SafetensorError as e:
            raise ValueError(f"safetensors file {file!r} is corrupt or unreadable: {e}") from e
        for name, shape in shapes.items():
            want = expected.get(name)
            if want is not None and shape != tuple(want):
                raise ValueError(f"safetensors file {file!r}: tensor {name!r} has shape {list(shape)}; "
                                 f"config.json implies {list(want)}")


def _iterate_file(file: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, _finite(file, name, f.get_tensor(name))
    except SafetensorError as e:
        raise ValueError(f"safetensors file {file!r} is corrupt or unreadable: {e}") from e


FP8_DTYPES = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name))


def _non_finite(tensor: torch.Tensor) -> torch.Tensor:
    """A bool mask of the NaN / infinite entries (FP8 has no isfinite: its NaN and inf bit patterns)."""
    if tensor.dtype in FP8_DTYPES:
        bits = tensor.view(torch.uint8) & 0x7F
        return bits == 0x7F if tensor.dtype == torch.float8_e4m3fn else bits >= 0x7C
    return ~torch.isfinite(tensor)


def _finite(file: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, refused when a floating-point weight holds NaN or infinity (one pass over it)."""
    if tensor.is_floating_point() and bool(_non_finite(tensor).any()):
        bad = int(_non_finite(tensor).sum())
        raise ValueError(f"safetensors file {file!r}: tensor {name!r} holds {bad} NaN or infinite values; "
                         "expected finite weights")
    return tensor


def _iterate_files(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        yield from _iterate_file(file)


def iterate_safetensors(path: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of the model in `path`, shard by shard.

    The file list is checked when this is called, so a missing shard fails at once; a corrupt
    file fails when it is reached.
    """
    return _iterate_files(safetensors_files(path))


def get_model_spec(registry_models: dict[str, Any], config):
    """The ModelSpec for `config.architectures[0]`; a clear error listing the registered ones."""
    registered = ", ".join(sorted(registry_models)) or "none"
    architectures = getattr(config, "architectures", None) or []
    if isinstance(architectures, str):  # a config built in Python; config.json is checked on reading
        architectures = [architectures]
    if not architectures:
        raise ValueError(f"model config: expected an 'architectures' entry, got none; registered: {registered}")
    architecture = architectures[0]
    if architecture not in registry_models:
        raise ValueError(
            f"model architecture {architecture!r} is not registered; registered: {registered} "
            "(a plugin can add one with the backplane_register_models hook)"
        )
    return registry_models[architecture]


# -- quantization: which layers the core hands to the method ---------------------------------------

def checkpoint_quant_format(config) -> str | None:
    """config.json's `quantization_config.quant_method` ("compressed-tensors", "fp8"), or None when the
    checkpoint is not quantized; a quantization_config without a quant_method string is a ValueError."""
    qc = quantization_config_of(config)
    if qc is None:
        return None
    method = qc.get("quant_method")
    if not isinstance(method, str) or not method:
        raise ValueError(f"model config: quantization_config.quant_method = {method!r}: expected the name of the "
                         "format (compressed-tensors, fp8, ...)")
    return method


def quantization_config_of(config) -> dict[str, Any] | None:
    """config.json's `quantization_config` as a dict (transformers may hold it as an object), or None."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    if not isinstance(qc, dict):
        raise ValueError(f"model config: quantization_config: expected a JSON object, got {type(qc).__name__}")
    return dict(qc)


def checkpoint_parts(module_name: str, stacked_params) -> list[str]:
    """The checkpoint module names a (possibly fused) layer holds: `...qkv_proj` -> its q/k/v_proj."""
    dotted = module_name + "."
    parts = [dotted.replace(fused, original)[:-1] for fused, original, _ in stacked_params if fused in dotted]
    return parts or [module_name]


def quantize_linears(model: torch.nn.Module, quant, stacked_params=None) -> list[str]:
    """Hand every linear layer of `model` that the checkpoint does not keep in high precision to
    `quant.method_for(layer, name)` (a QuantConfig); returns the names of the layers kept unquantized.

    The core decides: a layer is kept when its checkpoint name matches `quant.ignore` (a fused layer
    when all its parts match; some but not all is a ValueError naming them). Embeddings and lm_head
    are not linear layers, so they stay in the model dtype."""
    from backplane.contracts.quant import module_matches
    from backplane.layers.linear import _LinearBase
    from backplane.models.weights import STACKED_PARAMS

    stacked = STACKED_PARAMS if stacked_params is None else stacked_params
    patterns = tuple(quant.ignore)
    kept = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, _LinearBase):
            continue
        parts = checkpoint_parts(name, stacked)
        ignored = [p for p in parts if any(module_matches(p, pat) for pat in patterns)]
        if ignored and len(ignored) != len(parts):
            raise ValueError(f"quantization_config ignore list: {', '.join(ignored)} kept in high precision but "
                             f"{', '.join(p for p in parts if p not in ignored)} not, and they are fused into {name}; "
                             "expected all of them or none")
        method = None if ignored else quant.method_for(module, name)
        if method is None:
            kept.append(name)
        else:
            module.set_quant_method(method)
    return kept


def process_weights_after_loading(model: torch.nn.Module) -> None:
    """Every quantized layer's once-after-loading step (combining scales, online quantization)."""
    for module in model.modules():
        if getattr(module, "quant_method", None) is not None:
            module.quant_method.process_weights_after_loading(module)
