"""Phi-3 on the public model API: the Llama family's model with Phi-3's checkpoint layout.

The decoder is Llama's (pre-norm RMSNorm, SiLU-gated MLP, neox rotary on a leading `rotary_dim`
part of each head; long-rope through the core's RotaryEmbedding), so `Phi3ForCausalLM` subclasses
`backplane.models.llama.LlamaForCausalLM`. Only the checkpoint differs: q/k/v are one `qkv_proj`
tensor ([q; k; v] along the output dim) and gate/up one `gate_up_proj` ([gate; up]). `load_weights`
splits them into the parts the tensor-parallel loaders shard, so every rank keeps its own heads and
its own gate/up rows.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from backplane.models import ModelContext, head_dim_of, load_named_weights, num_kv_heads_of
from backplane.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """forward(batch) -> ModelOutput, as LlamaForCausalLM; Phi-3's fused checkpoint tensors."""

    def checkpoint_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every tensor of a Hugging Face Phi-3 checkpoint with its full (unsplit) shape."""
        return phi3_checkpoint_shapes(self.config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> set[str]:
        """Load (hf_name, full tensor) pairs; the fused qkv_proj / gate_up_proj tensors are split into
        their parts first, so each goes through its layer's tensor-parallel shard logic."""
        return load_named_weights(self, split_fused(weights, self.config), strict=strict)


def split_fused(weights: Iterable[tuple[str, torch.Tensor]], config) -> Iterator[tuple[str, torch.Tensor]]:
    """Phi-3's fused tensors as the Llama-layout parts load_named_weights maps: `qkv_proj` ->
    q_proj, k_proj, v_proj (rows [q | k | v]); `gate_up_proj` -> gate_proj, up_proj (rows [gate | up])."""
    head_dim = head_dim_of(config)
    q_size, kv_size = config.num_attention_heads * head_dim, num_kv_heads_of(config) * head_dim
    for name, tensor in weights:
        if ".qkv_proj." in name:
            expected = q_size + 2 * kv_size
            if tensor.shape[0] != expected:
                raise ValueError(f"checkpoint tensor {name!r}: expected {expected} rows (q {q_size} + k, v "
                                 f"{kv_size} each), got shape {tuple(tensor.shape)}")
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), tensor.split([q_size, kv_size, kv_size])):
                yield name.replace(".qkv_proj.", f".{part}."), piece
        elif ".gate_up_proj." in name:
            expected = 2 * config.intermediate_size
            if tensor.shape[0] != expected:
                raise ValueError(f"checkpoint tensor {name!r}: expected {expected} rows (gate and up, "
                                 f"{config.intermediate_size} each), got shape {tuple(tensor.shape)}")
            gate, up = tensor.chunk(2, dim=0)
            yield name.replace(".gate_up_proj.", ".gate_proj."), gate
            yield name.replace(".gate_up_proj.", ".up_proj."), up
        else:
            yield name, tensor


def phi3_checkpoint_shapes(config) -> list[tuple[str, tuple[int, ...]]]:
    """Names and full shapes of a Hugging Face Phi-3 checkpoint, in a fixed order."""
    hidden, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    head_dim = head_dim_of(config)
    q_size, kv_size = config.num_attention_heads * head_dim, num_kv_heads_of(config) * head_dim
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes += [(f"{p}self_attn.qkv_proj.weight", (q_size + 2 * kv_size, hidden)),
                   (f"{p}self_attn.o_proj.weight", (hidden, q_size)),
                   (f"{p}mlp.gate_up_proj.weight", (2 * inter, hidden)),
                   (f"{p}mlp.down_proj.weight", (hidden, inter)),
                   (f"{p}input_layernorm.weight", (hidden,)),
                   (f"{p}post_attention_layernorm.weight", (hidden,))]
    shapes.append(("model.norm.weight", (hidden,)))
    if not getattr(config, "tie_word_embeddings", False):
        shapes.append(("lm_head.weight", (vocab, hidden)))
    return shapes


def build_model(hf_config, ctx: ModelContext) -> Phi3ForCausalLM:
    """Phi3ForCausalLM with its parameters on ctx.device in ctx.dtype (uninitialised until loaded)."""
    with torch.device(ctx.device):
        return Phi3ForCausalLM(hf_config, ctx).eval()
