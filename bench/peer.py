"""The peer: a plain-PyTorch Llama (gpt-fast's shape of loop) with a static KV cache and random
weights, under torch.compile(mode="reduce-overhead") (or max-autotune-no-cudagraphs and a CUDA graph
per shape), decoding, prefilling and extending over a cached prefix at the engine's shapes in the
engine's process. The engine is compared with it side by side (bench/decode.py, bench/prefill.py,
bench/ttft.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.timing import captured, device_kernels, profiled, timed, wall_ms


class PeerLlama(torch.nn.Module):
    """forward(ids [bs, T], pos [1]: the position of ids[:, 0], over_cache) -> the next greedy ids [bs].

    T == 1, or over_cache, attends over the cache (a mask hides each token's later positions: a
    decode step, or an extend of T tokens after `pos` cached ones); else T tokens are a causal
    prefill from position 0 over the new tokens alone. Attention is SDPA with enable_gqa (it beat
    gpt-fast's K/V heads repeated to the query heads at every size measured)."""

    def __init__(self, cfg, bs: int, max_len: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.h, self.nh, self.nkv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or self.h // self.nh
        self.eps, inter, n = cfg.rms_norm_eps, cfg.intermediate_size, cfg.num_hidden_layers

        def w(*shape):
            return torch.nn.Parameter(torch.randn(*shape, dtype=dtype, device=device) * 0.02, requires_grad=False)

        self.embed = w(cfg.vocab_size, self.h)
        self.lm_head = self.embed if cfg.tie_word_embeddings else w(cfg.vocab_size, self.h)
        q, kv = self.nh * self.hd, self.nkv * self.hd
        self.qkv = torch.nn.ParameterList([w(q + 2 * kv, self.h) for _ in range(n)])
        self.o = torch.nn.ParameterList([w(self.h, q) for _ in range(n)])
        self.gate_up = torch.nn.ParameterList([w(2 * inter, self.h) for _ in range(n)])
        self.down = torch.nn.ParameterList([w(self.h, inter) for _ in range(n)])
        self.norms = torch.nn.Parameter(torch.ones(2 * n + 1, self.h, dtype=dtype, device=device), requires_grad=False)
        # NOTE: one cache buffer per layer, [bs, kv_heads, max_len, head_dim], written by index_put as
        # gpt-fast's KVCache.update does: one 5-D buffer indexed by layer made Inductor copy the whole
        # cache at every layer's write (7.3 ms a step at bs 32 on an H100).
        for i in range(n):
            for name in ("k", "v"):
                cache = torch.randn(bs, self.nkv, max_len, self.hd, dtype=dtype, device=device) * 0.1
                self.register_buffer(f"{name}_cache_{i}", cache, persistent=False)
        inv = 1.0 / (getattr(cfg, "rope_theta", 10000.0) ** (torch.arange(0, self.hd, 2, device=device).float() / self.hd))
        freqs = torch.outer(torch.arange(max_len, device=device).float(), inv)
        self.register_buffer("cos", freqs.cos().to(dtype), persistent=False)
        self.register_buffer("sin", freqs.sin().to(dtype), persistent=False)
        self.register_buffer("arange", torch.arange(max_len, device=device), persistent=False)

    def rms(self, x, i):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.norms[i]

    def rope(self, x, positions):  # x: [bs, heads, T, hd], rotate-half layout; positions: [T]
        t = positions.shape[0]
        cos, sin = self.cos[positions].view(1, 1, t, -1), self.sin[positions].view(1, 1, t, -1)
        x1, x2 = x[..., : self.hd // 2], x[..., self.hd // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, over_cache: bool = False) -> torch.Tensor:
        bs, t = ids.shape
        positions = pos + self.arange[:t]  # [T]
        x = self.embed[ids]  # [bs, T, h]
        for i in range(len(self.qkv)):
            q, k, v = (self.rms(x, 2 * i) @ self.qkv[i].t()).split(
                [self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], dim=-1)
            q = self.rope(q.view(bs, t, self.nh, self.hd).transpose(1, 2), positions)
            k = self.rope(k.view(bs, t, self.nkv, self.hd).transpose(1, 2), positions)
            v = v.view(bs, t, self.nkv, self.hd).transpose(1, 2)
            k_cache, v_cache = getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}")
            k_cache[:, :, positions] = k  # index_put in place
            v_cache[:, :, positions] = v
            att = self.attend(q, k_cache, v_cache, positions) if t == 1 or over_cache else self.causal(q, k, v)
            x = x + att.transpose(1, 2).reshape(bs, t, -1) @ self.o[i].t()
            gate, up = (self.rms(x, 2 * i + 1) @ self.gate_up[i].t()).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ self.down[i].t()
        return (self.rms(x[:, -1], -1) @ self.lm_head.t()).argmax(dim=-1)

    def attend(self, q, k, v, positions):
        """Queries at `positions` [T] over the cache: each one's later positions are masked."""
        mask = (self.arange.view(1, -1) <= positions.view(-1, 1)).view(1, 1, positions.shape[0], -1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.nh > self.nkv)

    def causal(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.nh > self.nkv)


COMPILE_MODES = ("reduce-overhead", "max-autotune-no-cudagraphs")


def build(cfg, bs: int, max_len: int, device: torch.device, compile_: bool, mode: str = "reduce-overhead"):
    """(the peer, its step function): compiled with `mode` (one specialisation per shape) unless
    compile_ is False. Dynamo is reset first: several peers of one forward would pass its recompile limit."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = PeerLlama(cfg, bs, max_len, dtype, device)
    torch._dynamo.reset()
    return model, (torch.compile(model, mode=mode, fullgraph=True, dynamic=False) if compile_ else model)


@torch.inference_mode()
def decode_ms(cfg, bs: int, context: int, steps: int, device: torch.device, compile_: bool,
              profile: bool = False) -> tuple[float, dict | None]:
    """(ms per decode step at `context`, and with `profile` the device kernels of a step:
    {"kernel_ms", "launches", "top_kernels"}). Greedy ids are fed back on the device; the position
    advances by an in-place device write, so no step waits for the host."""
    _, step = build(cfg, bs, context + steps + 8, device, compile_)
    ids = torch.zeros(bs, 1, dtype=torch.long, device=device)
    pos = torch.tensor([context], device=device)  # 1-D: a 0-d index is data-dependent to dynamo

    def run(n: int):
        nonlocal ids
        for i in range(n):
            pos.fill_(context + i)
            ids = step(ids, pos).clone().view(bs, 1)

    run(3)  # warm-up and capture
    ms = timed(lambda: run(steps), device)[0] * 1e3 / steps
    if not (profile and device.type == "cuda"):
        return ms, None
    kernels = device_kernels(profiled(lambda: run(steps), device)[0], steps)
    return ms, {"kernel_ms": sum(k[1] for k in kernels), "launches": sum(k[2] for k in kernels), "top_kernels": kernels[:8]}


@torch.inference_mode()
def prefill_ms(cfg, bs: int, length: int, device: torch.device, compile_: bool, repeats: int = 10) -> float:
    """Median ms of one prefill forward of `bs` prompts of `length` tokens (K/V written, the next ids chosen)."""
    _, step = build(cfg, bs, length + 8, device, compile_)
    ids = torch.randint(3, min(1000, cfg.vocab_size), (bs, length), device=device)
    pos = torch.zeros(1, dtype=torch.long, device=device)
    return wall_ms(lambda: step(ids, pos).clone(), device, repeats, warmup=3)


@torch.inference_mode()
def extend_ms(cfg, cases: list[tuple[int, int]], device: torch.device, compile_: bool, repeats: int = 10,
              mode: str = "reduce-overhead", decode_steps: int = 32) -> dict[tuple[int, int], float]:
    """{(prefix, new): median ms of one synchronised call} of one request's `new` tokens after
    `prefix` cached ones (prefix 0: a fresh causal prefill; the cache's contents are random: only
    the time counts), each shape compiled once on one peer; with decode_steps, also
    {(prefix, 0): ms per step} of decode_steps back-to-back one-token calls at position `prefix`
    (no step waits for the host), for every case of one new token. Under max-autotune-no-cudagraphs
    each shape's call is captured in a CUDA graph of its own (as reduce-overhead does by itself)."""
    _, step = build(cfg, 1, max(p + n for p, n in cases) + 8, device, compile_, mode)
    times: dict[tuple[int, int], float] = {}
    for prefix, new in cases:
        call = _call(step, cfg, prefix, new, device, compile_ and mode != "reduce-overhead")
        times[(prefix, new)] = wall_ms(call, device, repeats, warmup=3)
        if new == 1 and decode_steps:
            times[(prefix, 0)] = timed(lambda c=call: [c() for _ in range(decode_steps)], device)[0] * 1e3 / decode_steps
    return times


def _call(step, cfg, prefix: int, new: int, device: torch.device, graph: bool):
    """A no-argument call of `step` on `new` random ids at position `prefix`; replayed from a CUDA
    graph when `graph` (on CUDA)."""
    ids = torch.randint(3, min(1000, cfg.vocab_size), (1, new), device=device)
    pos = torch.tensor([prefix], device=device)  # 1-D: a 0-d index is data-dependent to dynamo

    def call():
        return step(ids, pos, over_cache=prefix > 0).clone()

    return captured(call)[0] if graph and device.type == "cuda" else call
