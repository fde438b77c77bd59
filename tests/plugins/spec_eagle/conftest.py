"""Fixtures of the EAGLE tests: a saved one-layer tiny Llama target and two draft heads for it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from helpers_models import make_hf_model, tiny_hf_config


@pytest.fixture(scope="session")
def target(tmp_path_factory):
    """A saved one-layer tiny Llama and its transformers model."""
    model = make_hf_model(tiny_hf_config("LlamaForCausalLM", num_hidden_layers=1), seed=3)
    path = tmp_path_factory.mktemp("target")
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def _save_head(path, config, tensors: dict) -> str:
    path.mkdir(parents=True, exist_ok=True)
    doc = config.to_dict()
    doc.update(architectures=["LlamaForCausalLMEagle"], num_hidden_layers=1)
    (path / "config.json").write_text(json.dumps(doc))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return str(path)


@pytest.fixture(scope="session")
def exact_head(target, tmp_path_factory):
    """A head that reproduces the one-layer target: fc picks the token embedding, then the target's
    own layer 0, final norm and lm_head, so its prediction at every position is the target's."""
    _, model = target
    hidden = model.config.hidden_size
    tensors = {"fc.weight": torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], 1),
               "norm.weight": model.model.norm.weight.detach().clone()}
    for name, value in model.model.layers[0].state_dict().items():
        tensors[f"model.layers.0.{name}"] = value.detach().clone()  # the model.-prefixed layout
    return _save_head(tmp_path_factory.mktemp("exact"), model.config, tensors)


@pytest.fixture(scope="session")
def random_head(target, tmp_path_factory):
    """EAGLE's usual layout: no input norm, no final norm, fc with bias, own embedding."""
    _, model = target
    gen = torch.Generator().manual_seed(11)
    tensors = {}
    for name, value in model.model.layers[0].state_dict().items():
        if "input_layernorm" not in name:
            tensors[f"layers.0.{name}"] = 0.1 * torch.randn(value.shape, generator=gen)
    h = model.config.hidden_size
    tensors.update({"fc.weight": 0.1 * torch.randn(h, 2 * h, generator=gen), "fc.bias": 0.1 * torch.randn(h, generator=gen),
                    "embed_tokens.weight": torch.randn(model.config.vocab_size, h, generator=gen)})
    return _save_head(tmp_path_factory.mktemp("random"), model.config, tensors)
