"""The MoE peer: a plain-PyTorch Qwen3-MoE decode loop in gpt-fast's shape (static KV cache, the
whole step under torch.compile(mode="reduce-overhead"), gpt-fast's Mixtral MoE: each token gathers
its k experts' weights, w1[ids], and contracts them with einsum), built on the engine's own weight
tensors so that the two compute one function from one copy of the weights (bench/moe_decode.py).

Nothing is copied: the peer's parameters are the engine model's Parameters, or aliasing views of
them (w1 and w3 are the two halves of the FusedMoE's w13_weight [E, 2I, H]; w2_weight [E, H, I]
is used as it is), and the rotary table is the engine's cos_sin_cache. The peer owns only its KV
cache (one [bs, kv_heads, max_len, head_dim] buffer per layer and for K and V) and its activations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.moe_layer import PEER_GATHER_BYTES, PeerMoe
from bench.peer import PeerLlama

PREFILL_CHUNK = 512  # tokens per dense MoE call in a prefill: [E, 512, I] activations, not [E, T, I]


def _experts(block, dense: bool) -> PeerMoe:
    """bench.moe_layer's gpt-fast MoE on a FusedMoE `block`, its w1/w3 views registered as Parameters
    (same storage): Parameters are static inputs to the reduce-overhead graphs, where a plain tensor
    attribute could be copied into the graph's input buffer at every replay."""
    experts = PeerMoe(block, dense)
    experts.w1, experts.w3 = (torch.nn.Parameter(w, requires_grad=False) for w in (experts.w1, experts.w3))
    return experts


def check_supported(model) -> None:
    """A one-line ValueError when `model` (the engine's) is not a Qwen3-MoE this peer reproduces: every
    layer a FusedMoE `mlp` without shared expert, renormalised top-k, q/k norms without q/k/v bias,
    full rotary, one rank; and the experts' weights in the FusedMoE layout."""
    layers, attn = model.model.layers, model.model.layers[0].self_attn
    blocks = [getattr(layer, "mlp", None) for layer in layers]
    checks = [
        (all(hasattr(b, "w13_weight") and b.shared_expert is None and b.renormalize for b in blocks),
         "every layer's mlp a FusedMoE with renormalised top-k and no shared expert"),
        (attn.q_norm is not None and getattr(attn.qkv_proj, "bias", None) is None, "q/k norms and no q/k/v bias"),
        (attn.rotary_emb.cos_sin_cache.shape[-1] == attn.head_dim, "rotary over the whole head"),
        (model.model.embed_tokens.parallel.tp_size == 1, "one tensor-parallel rank"),
    ]
    for ok, expected in checks:
        if not ok:
            raise ValueError(f"the MoE peer: expected a Qwen3MoeForCausalLM with {expected}; got a "
                             f"{type(model).__name__} without")
    w13, w2 = blocks[0].w13_weight, blocks[0].w2_weight
    if w13.dim() != 3 or w2.dim() != 3 or w13.shape[1] != 2 * w2.shape[2] or w13.shape[2] != w2.shape[1]:
        raise ValueError(f"the MoE peer: expected w13_weight [E, 2I, H] and w2_weight [E, H, I], got "
                         f"{tuple(w13.shape)} and {tuple(w2.shape)} (did the MoE backend re-lay them out?)")


class PeerQwen3Moe(torch.nn.Module):
    """forward(ids [bs, T], pos [1]) -> (greedy next ids [bs], last position's logits [bs, vocab]).

    T == 1: a decode step at position `pos` over the cache (later positions masked); T > 1: a causal
    prefill of T tokens from position 0 (pos must be 0), writing the cache. `model` is the engine's
    Qwen3MoeForCausalLM; its weights are shared, never copied. Attention is PeerLlama's (SDPA with
    enable_gqa over the whole static cache with a mask); the MoE is gpt-fast's gathered einsum while
    the gathered weights stay under PEER_GATHER_BYTES (decode), else (prefill) every expert on chunks
    of PREFILL_CHUNK tokens. RMSNorm and rotary follow the engine's plain-torch ops (fp32 inside)."""

    attend, causal = PeerLlama.attend, PeerLlama.causal  # read self.arange, self.nh, self.nkv

    def __init__(self, model, bs: int, max_len: int):
        super().__init__()
        check_supported(model)
        cfg, layers = model.config, model.model.layers
        attn = layers[0].self_attn
        self.nh, self.nkv, self.hd = attn.qkv_proj.num_heads, attn.qkv_proj.num_kv_heads, attn.head_dim
        self.eps, self.top_k = cfg.rms_norm_eps, layers[0].mlp.top_k
        self.embed, self.lm_head, self.final_norm = model.model.embed_tokens.weight, model.lm_head.weight, model.model.norm.weight

        def params(get):
            return torch.nn.ParameterList([get(layer) for layer in layers])

        self.qkv, self.o = params(lambda L: L.self_attn.qkv_proj.weight), params(lambda L: L.self_attn.o_proj.weight)
        self.q_norm, self.k_norm = params(lambda L: L.self_attn.q_norm.weight), params(lambda L: L.self_attn.k_norm.weight)
        self.attn_norm = params(lambda L: L.input_layernorm.weight)
        self.mlp_norm = params(lambda L: L.post_attention_layernorm.weight)
        self.gathered = torch.nn.ModuleList(_experts(L.mlp, dense=False) for L in layers)
        self.dense = torch.nn.ModuleList(_experts(L.mlp, dense=True) for L in layers)
        w13, w2 = layers[0].mlp.w13_weight, layers[0].mlp.w2_weight
        self.pair_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()  # one expert's weights
        device, dtype = self.embed.device, self.embed.dtype
        # NOTE: one cache buffer per layer, as PeerLlama (a single 5-D buffer made Inductor copy it whole)
        for i in range(len(layers)):
            for name in ("k", "v"):
                cache = torch.zeros(bs, self.nkv, max_len, self.hd, dtype=dtype, device=device)
                self.register_buffer(f"{name}_cache_{i}", cache, persistent=False)
        self.register_buffer("cos_sin", attn.rotary_emb.cos_sin_cache, persistent=False)  # [max_pos, hd] fp32, shared
        self.register_buffer("arange", torch.arange(max_len, device=device), persistent=False)

    def rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * weight.float()).to(x.dtype)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [bs, heads, T, hd] (rotate-half pairs, fp32 inside); positions: [T]."""
        cos, sin = self.cos_sin[positions].view(1, 1, positions.shape[0], -1).float().chunk(2, dim=-1)
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    def moe(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """x: [N, H] -> [N, H] through layer i's router and experts."""
        if x.shape[0] * self.top_k * self.pair_bytes <= PEER_GATHER_BYTES:
            return self.gathered[i](x)
        return torch.cat([self.dense[i](chunk) for chunk in x.split(PREFILL_CHUNK)])

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bs, t = ids.shape
        positions = pos + self.arange[:t]  # [T]
        x = F.embedding(ids, self.embed)  # [bs, T, H]
        for i in range(len(self.qkv)):
            x = x + self.attention(i, self.rms(x, self.attn_norm[i]), positions)
            x = x + self.moe(i, self.rms(x, self.mlp_norm[i]).view(bs * t, -1)).view(bs, t, -1)
        logits = self.rms(x[:, -1], self.final_norm) @ self.lm_head.t()  # [bs, vocab]
        return logits.argmax(dim=-1), logits

    def attention(self, i: int, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """h: [bs, T, H] normed -> the attention block's output [bs, T, H], layer i's K/V cached."""
        bs, t, _ = h.shape
        q, k, v = (h @ self.qkv[i].t()).split([self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], dim=-1)
        q = self.rope(self.rms(q.view(bs, t, self.nh, self.hd), self.q_norm[i]).transpose(1, 2), positions)
        k = self.rope(self.rms(k.view(bs, t, self.nkv, self.hd), self.k_norm[i]).transpose(1, 2), positions)
        v = v.view(bs, t, self.nkv, self.hd).transpose(1, 2)  # [bs, kv_heads, T, hd]
        k_cache, v_cache = getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}")
        k_cache[:, :, positions] = k  # index_put in place
        v_cache[:, :, positions] = v
        att = self.attend(q, k_cache, v_cache, positions) if t == 1 else self.causal(q, k, v)
        return att.transpose(1, 2).reshape(bs, t, -1) @ self.o[i].t()


def build(model, bs: int, max_len: int, compile_: bool) -> tuple[PeerQwen3Moe, object]:
    """(the peer on `model`'s weights, its step: the peer under torch.compile(mode="reduce-overhead",
    fullgraph, static shapes) unless compile_ is False). Dynamo is reset first: one peer per batch size."""
    peer = PeerQwen3Moe(model, bs, max_len)
    torch._dynamo.reset()
    return peer, (torch.compile(peer, mode="reduce-overhead", fullgraph=True, dynamic=False) if compile_ else peer)
