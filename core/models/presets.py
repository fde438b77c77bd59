"""Named model shapes for `--load-format dummy`: real architectures, random weights, no download.

The configs copy the shapes of the public checkpoints (rope scaling included) so that benchmarks
measure realistic kernels; `tiny-llama` is small enough for CPU tests and fits the byte tokenizer.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch

DUMMY_STD = 0.02
_SPECIAL_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}  # the byte tokenizer's


def _llama(**kwargs):
    from transformers import LlamaConfig

    return LlamaConfig(architectures=["LlamaForCausalLM"], hidden_act="silu", **_SPECIAL_IDS, **kwargs)


def _llama3(**kwargs):
    rope_scaling = {"rope_type": "llama3", "factor": kwargs.pop("factor"), "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    return _llama(num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                  max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                  rope_scaling=rope_scaling, **kwargs)


def _qwen(config_class: str, architecture: str, **kwargs):
    import transformers

    cls = getattr(transformers, config_class)
    return cls(architectures=[architecture], hidden_act="silu", vocab_size=151936, rms_norm_eps=1e-6,
               rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False,
               **_SPECIAL_IDS, **kwargs)


PRESETS: dict[str, Callable] = {
    "tiny-llama": lambda: _llama(
        # head dim 64: small enough for CPU tests, supported by every GPU attention backend
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False,
    ),
    "llama-3.2-1b": lambda: _llama3(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, head_dim=64, factor=32.0,
        tie_word_embeddings=True,
    ),
    "llama-3.1-8b": lambda: _llama3(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, head_dim=128, factor=8.0,
        tie_word_embeddings=False,
    ),
    "qwen2.5-0.5b": lambda: _qwen(
        "Qwen2Config", "Qwen2ForCausalLM", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, max_window_layers=24,
    ),
    "qwen3-0.6b": lambda: _qwen(
        "Qwen3Config", "Qwen3ForCausalLM", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        max_window_layers=28, attention_bias=False,
    ),
}


def get_preset(name: str):
    """A fresh transformers config for the preset `name`; ValueError listing the presets otherwise."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; expected one of: {', '.join(PRESETS)}")
    return PRESETS[name]()


def dummy_weights(
    shapes: list[tuple[str, tuple[int, ...]]], seed: int, device: torch.device | str = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full fp32 tensor on `device`) for each checkpoint tensor: ones for norms, N(0, 0.02) otherwise.

    Each tensor is drawn from its own generator on `device` seeded by (seed, its index), so on one
    kind of device the values do not depend on the dtype or the tensor-parallel split of the model
    they go into (every rank draws the same full tensor and keeps its shard). Drawing on the GPU
    keeps an 8B preset's start-up in seconds instead of a minute of CPU sampling.
    """
    device = torch.device(device)
    for index, (name, shape) in enumerate(shapes):
        if name.endswith("norm.weight"):
            yield name, torch.ones(shape, device=device)
            continue
        generator = torch.Generator(device).manual_seed((seed * 1_000_003 + index) % (2**63))
        yield name, torch.randn(shape, generator=generator, device=device) * DUMMY_STD


def init_dummy_weights(model, seed: int) -> None:
    """Fill `model` (a model with `checkpoint_shapes()` and `load_weights`) with deterministic weights,
    drawn on the device the model lives on."""
    device = next(model.parameters()).device
    model.load_weights(dummy_weights(model.checkpoint_shapes(), seed, device))
