"""Adapter files refused (or accepted) at load, each in one line naming the adapter and the field:
aLoRA's invocation tokens, a weights file with no tensors, a lora_alpha that overflows, and an empty
`modules_to_save` (accepted: it means none)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from backplane.lora.adapter import AdapterError, ProjectionShape, load_adapter

SHAPES = {"q_proj": ProjectionShape(16, 16), "v_proj": ProjectionShape(16, 8)}
RANK = 4


def write_adapter(path, tensors=None, **config):
    path.mkdir()
    base = {"peft_type": "LORA", "r": RANK, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    (path / "adapter_config.json").write_text(json.dumps({**base, **config}))
    gen = torch.Generator().manual_seed(0)
    if tensors is None:
        tensors = {}
        for layer in range(2):
            for proj, shape in SHAPES.items():
                key = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, shape.in_features, generator=gen) * 0.1
                tensors[f"{key}.lora_B.weight"] = torch.randn(shape.out_features, RANK, generator=gen) * 0.1
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def load(path):
    return load_adapter("ad", path, SHAPES, num_layers=2, max_rank=8, dtype=torch.float32)


def one_line_error(path) -> str:
    with pytest.raises(AdapterError) as err:
        load(path)
    message = str(err.value)
    assert "\n" not in message and "LoRA adapter 'ad'" in message
    return message


def test_alora_invocation_tokens_refused(tmp_path):
    message = one_line_error(write_adapter(tmp_path / "a", alora_invocation_tokens=[12, 34]))
    assert "alora_invocation_tokens=[12, 34] is not supported" in message


def test_adapter_without_tensors_refused(tmp_path):
    message = one_line_error(write_adapter(tmp_path / "a", tensors={}))
    assert "got a file with no tensors" in message


@pytest.mark.parametrize("alpha", [1e30, -1e30, 1e12])
def test_overflowing_lora_alpha_refused(tmp_path, alpha):
    message = one_line_error(write_adapter(tmp_path / "a", lora_alpha=alpha))
    assert f"lora_alpha={alpha:g}" in message and "expected at most" in message


def test_empty_modules_to_save_means_none(tmp_path):
    adapter = load(write_adapter(tmp_path / "a", modules_to_save=[], lora_alpha=16))
    assert adapter.scaling == 4.0 and len(adapter.weights) == 4
    assert "modules_to_save=['lm_head'] is not supported" in one_line_error(
        write_adapter(tmp_path / "b", modules_to_save=["lm_head"]))
