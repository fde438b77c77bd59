"""Gemma 2 and Gemma 3 (text) decoders, built only from the public model API.

Gemma 2 over a Llama-like decoder: the embedding scaled by sqrt(hidden_size), (1 + w) RMSNorms
(`GemmaRMSNorm`), sandwich norms (a norm before and after both attention and the MLP), a GeGLU MLP,
attention scaled by `query_pre_attn_scalar ** -0.5` with logit soft-capping, sliding-window layers
interleaved with global ones (`layer_types`), and a soft-capped final logit. Gemma 3 adds per-head
q/k norms and a rope base per layer type (`rope_local_base_freq` for the sliding layers), and, as in
transformers, no attention soft-cap (a Gemma 3 config's `attn_logit_softcapping` is ignored, with a warning).

Module names follow the Hugging Face checkpoints, except that q/k/v are fused into `qkv_proj` and
gate/up into `gate_up_proj` (so LoRA and tensor parallelism apply as for Llama).
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch
from torch import nn

from backplane.contracts import ForwardBatch
from backplane.layers import (
    Attention,
    GeluAndMul,
    LogitsProcessor,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from backplane.models import ModelContext, ModelOutput, head_dim_of, load_named_weights, num_kv_heads_of, rope_settings
from backplane.plugins.model_gemma import config as gemma_config
from backplane.plugins.model_gemma.norm import GemmaRMSNorm

logger = logging.getLogger(__name__)


class GemmaMLP(nn.Module):
    def __init__(self, config, ctx: ModelContext):
        super().__init__()
        size, inter = config.hidden_size, config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(size, [inter, inter], False, ctx.parallel, ctx.dtype)
        self.down_proj = RowParallelLinear(inter, size, False, ctx.parallel, ctx.dtype)
        self.act_fn = GeluAndMul(ctx, gemma_config.gelu_approximate(config))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class GemmaAttention(nn.Module):
    def __init__(self, config, layer_id: int, layer_type: str, ctx: ModelContext, qk_norm: bool,
                 rope: tuple[float, dict | None], softcap: float):
        super().__init__()
        head_dim = self.head_dim = head_dim_of(config)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          num_kv_heads_of(config), bias, ctx.parallel, ctx.dtype)
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, bias,
                                        ctx.parallel, ctx.dtype)
        self.q_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps, ctx.dtype) if qk_norm else None
        self.k_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps, ctx.dtype) if qk_norm else None
        theta, scaling = rope
        self.rotary_emb = RotaryEmbedding(head_dim, head_dim, config.max_position_embeddings, theta, scaling, True, ctx)
        self.attn = Attention(
            self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim, config.query_pre_attn_scalar**-0.5,
            layer_id, ctx, sliding_window=gemma_config.sliding_window(config, layer_type),
            logit_softcap=softcap,
        )

    def _norm_heads(self, norm: GemmaRMSNorm, x: torch.Tensor) -> torch.Tensor:
        # x: [T, heads * head_dim], normalised per head
        return norm(x.view(x.shape[0], -1, self.head_dim)).view(x.shape)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split(self.qkv_proj.output_sizes, dim=-1)
        if self.q_norm is not None:
            q, k = self._norm_heads(self.q_norm, q), self._norm_heads(self.k_norm, k)
        return self.o_proj(self.attn(q, k, v.contiguous(), batch, rotary=self.rotary_emb, positions=positions))


class GemmaDecoderLayer(nn.Module):
    """Sandwich norms: h += post_attn(attn(input(h))); h += post_ff(mlp(pre_ff(h)))."""

    def __init__(self, config, layer_id: int, layer_type: str, ctx: ModelContext, qk_norm: bool, rope, softcap: float):
        super().__init__()
        self.self_attn = GemmaAttention(config, layer_id, layer_type, ctx, qk_norm, rope, softcap)
        self.mlp = GemmaMLP(config, ctx)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps, ctx.dtype)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps, ctx.dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps, ctx.dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps, ctx.dtype)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """hidden: [T, hidden_size] -> [T, hidden_size]."""
        hidden = hidden + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(hidden), batch))
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class GemmaModel(nn.Module):
    def __init__(self, config, ctx: ModelContext, qk_norm: bool, rope_of, softcap: float):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, ctx.parallel, ctx.dtype)
        self.embed_scale = config.hidden_size**0.5
        types = gemma_config.layer_types(config)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, i, kind, ctx, qk_norm, rope_of(config, kind), softcap)
            for i, kind in enumerate(types)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, ctx.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """input_ids, positions: [T] -> final-normed hidden states [T, hidden_size]."""
        hidden = self.embed_tokens(input_ids)
        # NOTE: the scale is rounded to the model dtype first, as transformers does
        hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        for layer in self.layers:
            hidden = layer(positions, hidden, batch)
        return self.norm(hidden)


def _gemma2_rope(config, layer_type: str) -> tuple[float, dict | None]:
    theta, scaling, _ = rope_settings(config)
    return theta, scaling


class Gemma2ForCausalLM(nn.Module):
    """forward(batch) -> ModelOutput. Sizing attributes for the KV pool are per tensor-parallel rank."""

    qk_norm = False  # Gemma 3 normalises q and k per head before rope
    rope_of = staticmethod(_gemma2_rope)  # (config, layer type) -> (rope base, rope_scaling)
    attention_softcap = True  # Gemma 3 reads no attn_logit_softcapping (as in transformers)

    def __init__(self, config, ctx: ModelContext):
        super().__init__()
        self.config, self.ctx = config, ctx
        self.model = GemmaModel(config, ctx, self.qk_norm, self.rope_of, self._attention_softcap(config))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, ctx.parallel, ctx.dtype)
        final_cap = gemma_config.softcap(config, "final_logit_softcapping") or None
        self.logits_processor = LogitsProcessor(config.vocab_size, ctx.parallel, final_cap)
        first_attn = self.model.layers[0].self_attn
        self.num_layers = config.num_hidden_layers
        self.num_heads, self.num_kv_heads = first_attn.qkv_proj.num_heads, first_attn.qkv_proj.num_kv_heads
        self.head_dim = first_attn.head_dim
        self.hidden_size, self.vocab_size = config.hidden_size, config.vocab_size

    def _attention_softcap(self, config) -> float:
        cap = gemma_config.softcap(config, "attn_logit_softcapping")
        if cap and not self.attention_softcap:
            logger.warning("%s: attn_logit_softcapping=%s is ignored, as transformers ignores it for this model",
                           type(self).__name__, cap)
            return 0.0
        return cap

    def forward(self, batch: ForwardBatch) -> ModelOutput:
        """The bound ForwardContext (if any) says where the logits go and whether hidden states return."""
        bound = self.ctx.forward
        hidden = self.model(batch.input_ids, batch.positions, batch)  # [T, hidden_size]
        logits = self.logits_processor(hidden, self.lm_head, batch, out=bound.logits_out if bound else None)
        return ModelOutput(logits, hidden if bound is not None and bound.capture_hidden else None)

    def checkpoint_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every tensor of a Hugging Face checkpoint of this model with its full (unsplit) shape."""
        return gemma_config.gemma_checkpoint_shapes(self.config, self.qk_norm)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> set[str]:
        """Load (hf_name, full tensor) pairs into the fused, rank-local parameters; returns the names loaded."""
        return load_named_weights(self, weights, strict=strict)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text: Gemma 2 with per-head q/k norms and a rope base per layer type."""

    qk_norm = True
    rope_of = staticmethod(gemma_config.gemma3_rope)
    attention_softcap = False


def build_model(cls: type[Gemma2ForCausalLM], hf_config, ctx: ModelContext) -> Gemma2ForCausalLM:
    """Create `cls` with its parameters on ctx.device in ctx.dtype (uninitialised until loaded)."""
    with torch.device(ctx.device):
        return cls(hf_config, ctx).eval()
