"""Loading a local Hugging Face model directory: config, safetensors weights, the model class."""

from __future__ import annotations

import json
import os
from typing import Any, Iterator

import torch

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
    return AutoConfig.from_pretrained(path)


def safetensors_files(path: str | os.PathLike) -> list[str]:
    """The weight files of `path`: the shards named by model.safetensors.index.json, or model.safetensors."""
    path = os.fspath(path)
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (ValueError, KeyError) as e:
            raise ValueError(
                f"safetensors index {index!r} is corrupt: expected JSON with a 'weight_map' ({e})"
            ) from e
        files = [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
    elif os.path.isfile(os.path.join(path, SINGLE_FILE)):
        files = [os.path.join(path, SINGLE_FILE)]
    else:
        raise FileNotFoundError(f"model path {path!r}: expected {SINGLE_FILE} or {INDEX_FILE}, found neither")
    for file in files:
        if not os.path.isfile(file):
            raise FileNotFoundError(f"safetensors shard {file!r} named in {INDEX_FILE} is missing")
    return files


def _iterate_file(file: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
    except SafetensorError as e:
        raise ValueError(f"safetensors file {file!r} is corrupt or unreadable: {e}") from e


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
    if not architectures:
        raise ValueError(f"model config: expected an 'architectures' entry, got none; registered: {registered}")
    architecture = architectures[0]
    if architecture not in registry_models:
        raise ValueError(
            f"model architecture {architecture!r} is not registered; registered: {registered} "
            "(a plugin can add one with the backplane_register_models hook)"
        )
    return registry_models[architecture]
