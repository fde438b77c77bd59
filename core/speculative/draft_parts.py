"""Building blocks for draft models, so that algorithm plugins need no private core module.

`llama_decoder_layer` is the target family's own decoder layer (same ops, same weight names), and
`make_attention_backend` builds another instance of the target's attention backend over a draft
model's pools, through the same registry selection the target used.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from backplane.contracts.attention import AttentionBackend
from backplane.speculative.target import as_target


def llama_decoder_layer(config: Any, layer_id: int, model_ctx: Any) -> nn.Module:
    """A Llama decoder layer: forward(positions, hidden, residual, batch) -> (hidden, residual)."""
    from backplane.models.llama import LlamaDecoderLayer

    return LlamaDecoderLayer(config, layer_id, model_ctx, qkv_bias=False, qk_norm=False)


def load_named_weights(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> set[str]:
    """Load Hugging Face-named tensors (q_proj/k_proj/... fused on the fly) into `module`."""
    from backplane.models.weights import load_named_weights as load

    return load(module, weights, strict=strict)


def iterate_safetensors(path) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, tensor) of every *.safetensors file in directory `path`."""
    from backplane.models.loader import iterate_safetensors as iterate

    return iterate(path)


def load_config(path) -> Any:
    """The transformers config of a model directory."""
    from backplane.models.loader import load_hf_config

    return load_hf_config(path)


def make_attention_backend(runner: Any, role: str, req_to_token_pool, token_to_kv_pool, layers: list) -> AttentionBackend:
    """A new instance of the target's `role` ("prefill"/"decode") backend over other pools; `runner`
    is the model runner or its TargetView (`TargetRunner.make_attention_backend` is the same)."""
    return as_target(runner).make_attention_backend(role, req_to_token_pool, token_to_kv_pool, layers)


def graph_pool() -> Any:
    """The process-wide CUDA graph memory pool (shared by the target's and every draft's graphs)."""
    from backplane.executor.graph_runner import global_graph_pool

    return global_graph_pool()


def pool_bytes(pool: Any) -> int:
    """Bytes currently reserved by graph memory pool `pool` (how much a set of graphs grew it)."""
    from backplane.executor.graph_runner import pool_bytes as reserved

    return reserved(pool)


def padded_size(batch_size: int, sizes: list[int]) -> int | None:
    """The smallest captured size >= batch_size, or None."""
    from backplane.executor.graph_sizes import padded_size as pick

    return pick(batch_size, sizes)
