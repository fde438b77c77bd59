"""The Llama family: Llama, Mistral (sliding window), Qwen2 (q/k/v bias), Qwen3 (per-head q/k norm).

Module names follow the Hugging Face checkpoints, except that q/k/v are fused into `qkv_proj` and
gate/up into `gate_up_proj`; `load_weights` maps the checkpoint names onto them. Built only from the
public model API (backplane.contracts, backplane.layers, backplane.models), as a third-party model
plugin would be: tests/plugin/test_import_boundary.py holds it to that.

Public (`backplane.models.llama`) as the base of Llama-like families: a plugin for a family that
differs only in its checkpoint layout or a class attribute subclasses `LlamaForCausalLM` and
overrides `load_weights` / `checkpoint_shapes` (plugins/model_phi3 does).
"""

from __future__ import annotations

from typing import Callable, Iterable

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
    llama_checkpoint_shapes,
    load_named_weights,
    num_kv_heads_of,
    rope_settings,
    sliding_window_of,
)

__all__ = ["LlamaAttention", "LlamaDecoderLayer", "LlamaForCausalLM", "LlamaMLP", "LlamaModel",
           "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "build_model"]


class LlamaMLP(nn.Module):
    def __init__(self, config, ctx: ModelContext):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act: expected 'silu' for the Llama family, got {config.hidden_act!r}")
        bias = bool(getattr(config, "mlp_bias", False))
        size, inter = config.hidden_size, config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(size, [inter, inter], bias, ctx.parallel, ctx.dtype)
        self.down_proj = RowParallelLinear(inter, size, bias, ctx.parallel, ctx.dtype)
        self.act_fn = SiluAndMul(ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_id: int, ctx: ModelContext, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        head_dim = head_dim_of(config)
        self.head_dim = head_dim
        attention_bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, head_dim, config.num_attention_heads, num_kv_heads_of(config),
            qkv_bias or attention_bias, ctx.parallel, ctx.dtype,
        )
        num_heads, num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim, config.hidden_size, attention_bias, ctx.parallel, ctx.dtype
        )
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, ctx, ctx.dtype) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, ctx, ctx.dtype) if qk_norm else None
        theta, scaling, partial = rope_settings(config)
        self.rotary_emb = RotaryEmbedding(
            head_dim, int(head_dim * partial), config.max_position_embeddings, theta, scaling, True, ctx
        )
        self.attn = Attention(
            num_heads, num_kv_heads, head_dim, head_dim**-0.5, layer_id, ctx,
            sliding_window=sliding_window_of(config, layer_id),
        )

    def _norm_heads(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        # x: [T, heads * head_dim], normalised per head
        return norm(x.view(x.shape[0], -1, self.head_dim)).view(x.shape)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split(self.qkv_proj.output_sizes, dim=-1)
        if self.q_norm is not None:
            q, k = self._norm_heads(self.q_norm, q), self._norm_heads(self.k_norm, k)
        # rotary is applied by the attention layer: fused with the K/V write when the backend opts in
        return self.o_proj(self.attn(q, k, v.contiguous(), batch, rotary=self.rotary_emb, positions=positions))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, ctx: ModelContext, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, ctx, qkv_bias, qk_norm)
        self.mlp = LlamaMLP(config, ctx)
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
        return self.feed_forward(hidden), residual

    def feed_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's MLP on the post-attention-normed hidden states; a family whose MLP is another
        module (a mixture of experts under its checkpoint's name) overrides this."""
        return self.mlp(hidden)


class LlamaModel(nn.Module):
    def __init__(self, config, ctx: ModelContext, qkv_bias: bool, qk_norm: bool,
                 decoder_layer: Callable[[int], nn.Module] | None = None):
        """decoder_layer(layer_id): a family's own decoder layer (same forward signature as
        LlamaDecoderLayer), e.g. one whose MLP is a mixture of experts; default LlamaDecoderLayer."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, ctx.parallel, ctx.dtype)
        make = decoder_layer or (lambda i: LlamaDecoderLayer(config, i, ctx, qkv_bias, qk_norm))
        self.layers = nn.ModuleList(make(i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx, ctx.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """input_ids, positions: [T] -> final-normed hidden states [T, hidden_size]."""
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, batch)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """forward(batch) -> ModelOutput. Sizing attributes for the KV pool are per tensor-parallel rank."""

    qkv_bias = False  # Qwen2 always has q/k/v biases
    qk_norm = False  # Qwen3 normalises q and k per head before rope

    def __init__(self, config, ctx: ModelContext):
        super().__init__()
        self.config = config
        self.ctx = ctx
        self.model = LlamaModel(config, ctx, self.qkv_bias, self.qk_norm)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, ctx.parallel, ctx.dtype)
        softcap = getattr(config, "final_logit_softcapping", None)
        self.logits_processor = LogitsProcessor(config.vocab_size, ctx.parallel, softcap)
        first_attn = self.model.layers[0].self_attn
        self.num_layers = config.num_hidden_layers
        self.num_heads = first_attn.qkv_proj.num_heads
        self.num_kv_heads = first_attn.qkv_proj.num_kv_heads
        self.head_dim = first_attn.head_dim
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size

    def forward(self, batch: ForwardBatch) -> ModelOutput:
        """The bound ForwardContext (if any) says where the logits go and whether hidden states return."""
        bound = self.ctx.forward
        hidden = self.model(batch.input_ids, batch.positions, batch)  # [T, hidden_size]
        logits = self.logits_processor(hidden, self.lm_head, batch, out=bound.logits_out if bound else None)
        return ModelOutput(logits, hidden if bound is not None and bound.capture_hidden else None)

    def checkpoint_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every tensor of a Hugging Face checkpoint of this model with its full (unsplit) shape."""
        return llama_checkpoint_shapes(self.config, self.qkv_bias, self.qk_norm)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> set[str]:
        """Load (hf_name, full tensor) pairs into the fused, rank-local parameters.

        Returns the names of the loaded parameters. strict: raise when a checkpoint tensor has no
        parameter, or a parameter was not loaded.
        """
        return load_named_weights(self, weights, strict=strict)


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with the sliding window read from the config."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


def build_model(cls: type[LlamaForCausalLM], hf_config, ctx: ModelContext) -> LlamaForCausalLM:
    """Create `cls` with its parameters on ctx.device in ctx.dtype (uninitialised until loaded)."""
    with torch.device(ctx.device):
        return cls(hf_config, ctx).eval()
