"""OLMo 2 (transformers' Olmo2ForCausalLM) on backplane's public model-building API.

What differs from Llama: norms after attention and after the MLP instead of before them, and an
RMSNorm over the whole projected q and k (not per head) before rotary. Under tensor parallelism q
and k are split by heads, so that norm sums its squares over the ranks.
"""

import torch
from torch import nn

from backplane.layers import (Attention, LogitsProcessor, MergedColumnParallelLinear, ParallelLMHead,
                              QKVParallelLinear, RMSNorm, RotaryEmbedding, RowParallelLinear, SiluAndMul,
                              VocabParallelEmbedding)
from backplane.models import ModelOutput, head_dim_of, load_named_weights, num_kv_heads_of, rope_settings


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a vector split across ranks in `num_parts` equal parts; this rank holds `part`.

    The mean of squares is taken over the whole vector (local sums all-reduced); a part held by
    several ranks (replicated KV heads) counts once per holder, which leaves the mean unchanged.
    """

    def __init__(self, local_size, part, num_parts, eps, parallel, dtype):
        super().__init__()
        self.eps, self.parallel, self.part, self.num_parts = eps, parallel, part, num_parts
        self.weight = nn.Parameter(torch.ones(local_size, dtype=dtype))
        self.weight.weight_loader = self.load_shard

    def load_shard(self, param, full, shard_id=None):
        param.data.copy_(full.chunk(self.num_parts)[self.part])

    def forward(self, x):                                   # x: [T, local_size]
        x32 = x.float()
        sum_sq = x32.pow(2).sum(-1, keepdim=True)
        if self.parallel.tp_size > 1:
            sum_sq = self.parallel.all_reduce(sum_sq)
        mean_sq = sum_sq / (x.shape[-1] * self.parallel.tp_size)
        return (self.weight * (x32 * torch.rsqrt(mean_sq + self.eps))).to(x.dtype)


class Olmo2Attention(nn.Module):
    def __init__(self, cfg, layer_id, ctx):
        super().__init__()
        hd, p, dt, bias = head_dim_of(cfg), ctx.parallel, ctx.dtype, cfg.attention_bias
        total_kv = num_kv_heads_of(cfg)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, hd, cfg.num_attention_heads, total_kv, bias, p, dt)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * hd, cfg.hidden_size, bias, p, dt)
        q_size, k_size, _ = self.qkv_proj.output_sizes
        # KV heads: split over the ranks, or (fewer heads than ranks) each replicated on consecutive ranks.
        kv_parts = min(total_kv, p.tp_size)
        kv_part = p.tp_rank * kv_parts // p.tp_size
        self.q_norm = ShardedRMSNorm(q_size, p.tp_rank, p.tp_size, cfg.rms_norm_eps, p, dt)
        self.k_norm = ShardedRMSNorm(k_size, kv_part, kv_parts, cfg.rms_norm_eps, p, dt)
        theta, scaling, _ = rope_settings(cfg)
        self.rotary = RotaryEmbedding(hd, hd, cfg.max_position_embeddings, theta, scaling, True, ctx)
        self.attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, hd, hd**-0.5, layer_id, ctx)

    def forward(self, positions, x, batch):                 # x: [T, hidden]
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)
        return self.o_proj(self.attn(q, k, v.contiguous(), batch, rotary=self.rotary, positions=positions))


class Olmo2MLP(nn.Module):
    def __init__(self, cfg, ctx):
        super().__init__()
        size, inter, p, dt = cfg.hidden_size, cfg.intermediate_size, ctx.parallel, ctx.dtype
        self.gate_up_proj = MergedColumnParallelLinear(size, [inter, inter], False, p, dt)
        self.down_proj = RowParallelLinear(inter, size, False, p, dt)
        self.act = SiluAndMul(ctx)

    def forward(self, x):
        return self.down_proj(self.act(self.gate_up_proj(x)))


class Olmo2Layer(nn.Module):
    def __init__(self, cfg, layer_id, ctx):
        super().__init__()
        self.self_attn, self.mlp = Olmo2Attention(cfg, layer_id, ctx), Olmo2MLP(cfg, ctx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx, ctx.dtype)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx, ctx.dtype)

    def forward(self, positions, x, batch):                 # norms after each block, not before
        x = x + self.post_attention_layernorm(self.self_attn(positions, x, batch))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo2Model(nn.Module):
    def __init__(self, cfg, ctx):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx.parallel, ctx.dtype)
        self.layers = nn.ModuleList(Olmo2Layer(cfg, i, ctx) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx, ctx.dtype)

    def forward(self, batch):
        x = self.embed_tokens(batch.input_ids)              # [T, hidden]
        for layer in self.layers:
            x = layer(batch.positions, x, batch)
        return self.norm(x)


class Olmo2ForCausalLM(nn.Module):
    def __init__(self, cfg, ctx):
        super().__init__()
        self.ctx, self.cfg, self.model = ctx, cfg, Olmo2Model(cfg, ctx)
        self.tie_word_embeddings = cfg.tie_word_embeddings
        self.lm_head = (self.model.embed_tokens if self.tie_word_embeddings
                        else ParallelLMHead(cfg.vocab_size, cfg.hidden_size, ctx.parallel, ctx.dtype))
        self.logits_processor = LogitsProcessor(cfg.vocab_size, ctx.parallel)
        self.vocab_size, self.hidden_size = cfg.vocab_size, cfg.hidden_size
        attn = self.model.layers[0].self_attn
        self.num_layers, self.head_dim = cfg.num_hidden_layers, head_dim_of(cfg)
        self.num_heads, self.num_kv_heads = attn.qkv_proj.num_heads, attn.qkv_proj.num_kv_heads

    def forward(self, batch):
        hidden = self.model(batch)
        bound = self.ctx.forward                            # this forward's ForwardContext
        logits = self.logits_processor(hidden, self.lm_head, batch, out=bound.logits_out if bound else None)
        return ModelOutput(logits, hidden if bound is not None and bound.capture_hidden else None)

    def load_weights(self, weights, strict=True):           # q/k/v -> qkv_proj, gate/up -> gate_up_proj
        return load_named_weights(self, weights, strict=strict)

    def checkpoint_shapes(self):                            # for --load-format dummy
        cfg, hd = self.cfg, head_dim_of(self.cfg)
        size, inter, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * hd, num_kv_heads_of(cfg) * hd
        per_layer = {"self_attn.q_proj.weight": (q, size), "self_attn.k_proj.weight": (kv, size),
                     "self_attn.v_proj.weight": (kv, size), "self_attn.o_proj.weight": (size, q),
                     "self_attn.q_norm.weight": (q,), "self_attn.k_norm.weight": (kv,),
                     "mlp.gate_proj.weight": (inter, size), "mlp.up_proj.weight": (inter, size),
                     "mlp.down_proj.weight": (size, inter), "post_attention_layernorm.weight": (size,),
                     "post_feedforward_layernorm.weight": (size,)}
        if cfg.attention_bias:
            per_layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                              "self_attn.v_proj.bias": (kv,), "self_attn.o_proj.bias": (size,)})
        shapes = [(f"model.layers.{i}.{name}", shape) for i in range(cfg.num_hidden_layers)
                  for name, shape in per_layer.items()]
        shapes += [("model.embed_tokens.weight", (cfg.vocab_size, size)), ("model.norm.weight", (size,))]
        return shapes + ([] if self.tie_word_embeddings else [("lm_head.weight", (cfg.vocab_size, size))])
