"""A draft head whose own embedding does not match the target's vocabulary is refused in one line
naming the draft directory and the flag (issue 42), before any weight is loaded."""

from __future__ import annotations

import pytest
import torch
from conftest import _save_head

from backplane import Engine
from backplane.plugin.runtime import PluginRuntimeError


def test_a_draft_embedding_of_the_wrong_size_names_the_draft_and_the_flag(target, tmp_path):
    path, model = target
    h, vocab = model.config.hidden_size, model.config.vocab_size
    tensors = {"fc.weight": torch.zeros(h, 2 * h), "embed_tokens.weight": torch.zeros(vocab - 7, h)}
    for name, value in model.model.layers[0].state_dict().items():
        tensors[f"layers.0.{name}"] = value.detach().clone()
    head = _save_head(tmp_path / "short_vocab", model.config, tensors)
    with pytest.raises(PluginRuntimeError) as info:
        Engine(str(path), device="cpu", speculative_algorithm="eagle", plugin_options={"eagle": {"draft_model": head}})
    message = str(info.value)
    assert f"--eagle.draft-model {head!r}: embed_tokens.weight has shape ({vocab - 7}, {h}); expected ({vocab}, {h})" \
        in message and "\n" not in message
