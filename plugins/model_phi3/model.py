"""Phi-3 built from backplane.layers and backplane.models alone.

The decoder is Llama's (pre-norm RMSNorm, SiLU-gated MLP, neox rotary on a leading `rotary_dim`
part of each head) with Phi-3's checkpoint layout: q/k/v are one `qkv_proj` tensor ([q; k; v] along
the output dim) and gate/up one `gate_up_proj` ([gate; up]). `load_weights` splits them into the
parts the tensor-parallel loaders shard, so every rank keeps its own heads and its own gate/up rows.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn

from backplane.contracts import ForwardBatch
from backplane.layers import (
    Attention,
    LogitsProcessor,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
)
from backplane.models import (
    ModelContext,
    ModelOutput,
    head_dim_of,
    load_named_weights,
    num_kv_heads_of,
    rope_settings,
    sliding_window_of,
)


class Phi3MLP(nn.Module):
    def __init__(self, config, ctx: ModelContext):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act: expected 'silu' for Phi-3, got {config.hidden_act!r}")
        size, inter = config.hidden_size, config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(size, [inter, inter], False, ctx.parallel, ctx.dtype)
        self.down_proj = RowParallelLinear(inter, size, False, ctx.parallel, ctx.dtype)
        self.act_fn = SiluAndMul(ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Phi3Attention(nn.Module):
    def __init__(self, config, layer_id: int, ctx: ModelContext):
        super().__init__()
        head_dim = self.head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          num_kv_heads_of(config), False, ctx.parallel, ctx.dtype)
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, False,
                                        ctx.parallel, ctx.dtype)
        theta, scaling, partial = rope_settings(config)
        self.rotary_emb = RotaryEmbedding(head_dim, int(head_dim * partial), config.max_position_embeddings,
                                          theta, scaling, True, ctx)
        self.attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim, head_dim**-0.5,
                              layer_id, ctx, sliding_window=sliding_window_of(config, layer_id))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split(self.qkv_proj.output_sizes, dim=-1)
        return self.o_proj(self.attn(q, k, v.contiguous(), batch, rotary=self.rotary_emb, positions=positions))


class Phi3DecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, ctx: ModelContext):
        super().__init__()
        self.self_attn = Phi3Attention(config, layer_id, ctx)
        self.mlp = Phi3MLP(config, ctx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx, ctx.dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx, ctx.dtype)

    def forward(self, positions, hidden, residual, batch: ForwardBatch):
        """hidden, residual: [T, hidden_size] (residual None on the first layer) -> (hidden, residual)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Phi3Model(nn.Module):
    def __init__(self, config, ctx: ModelContext):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, ctx.parallel, ctx.dtype)
        self.layers = nn.ModuleList(Phi3DecoderLayer(config, i, ctx) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx, ctx.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """input_ids, positions: [T] -> final-normed hidden states [T, hidden_size]."""
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, batch)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Phi3ForCausalLM(nn.Module):
    """forward(batch) -> ModelOutput. Sizing attributes for the KV pool are per tensor-parallel rank."""

    def __init__(self, config, ctx: ModelContext):
        super().__init__()
        self.config, self.ctx = config, ctx
        self.model = Phi3Model(config, ctx)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = (self.model.embed_tokens if self.tie_word_embeddings
                        else ParallelLMHead(config.vocab_size, config.hidden_size, ctx.parallel, ctx.dtype))
        self.logits_processor = LogitsProcessor(config.vocab_size, ctx.parallel)
        first = self.model.layers[0].self_attn
        self.num_layers = config.num_hidden_layers
        self.num_heads, self.num_kv_heads = first.qkv_proj.num_heads, first.qkv_proj.num_kv_heads
        self.head_dim = first.head_dim
        self.hidden_size, self.vocab_size = config.hidden_size, config.vocab_size

    def forward(self, batch: ForwardBatch) -> ModelOutput:
        """The bound ForwardContext (if any) says where the logits go and whether hidden states return."""
        bound = self.ctx.forward
        hidden = self.model(batch.input_ids, batch.positions, batch)  # [T, hidden_size]
        logits = self.logits_processor(hidden, self.lm_head, batch, out=bound.logits_out if bound else None)
        return ModelOutput(logits, hidden if bound is not None and bound.capture_hidden else None)

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
