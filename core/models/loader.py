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


def load_hf_config(path: str | os.PathLike):
    """transformers' config of the local model directory `path`, with clear errors when absent."""
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
    return config


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


def _finite(file: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, refused when a floating-point weight holds NaN or infinity (one pass over it)."""
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
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
