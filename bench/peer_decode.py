"""Engine decode against a hand-written torch.compile Llama decode loop, same process and shapes.

The peer: a plain-PyTorch Llama (static KV cache, greedy tokens fed back on the device, random bf16
weights) compiled with torch.compile(mode="reduce-overhead"), decoding at context `--context`.
The engine: the whole `Engine.generate` loop at a fixed batch with ignore_eos, per step, as the
difference of two runs of different output lengths (so prefill cancels), with overlap scheduling
on and off; and the decode graph's replay alone (CUDA events around each replay inside a
generate). Also the weight-read floor (weight bytes / --hbm-tb-s) and, with --profile, where one
engine step's time goes at bs 1 and 32 (torch.profiler: device kernels against wall time).

  python bench/peer_decode.py --models llama-3.2-1b llama-3.1-8b --backends triton flashinfer --out r.json
  python bench/peer_decode.py --models tiny-llama --backends torch_native --batch-sizes 1 2 --device cpu --no-compile
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from backplane import Engine, SamplingParams
from backplane.engine.scheduler import Scheduler
from backplane.models.presets import get_preset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import copy_bandwidth_tb_s, device_gaps, device_kernels  # noqa: E402  (bench/timing.py)


class PeerLlama(torch.nn.Module):
    """gpt-fast-style Llama decode: x [bs] token ids at position `pos` -> next greedy ids [bs]."""

    def __init__(self, cfg, bs: int, max_len: int, dtype: torch.dtype, device: torch.device,
                 attention: str = "repeat"):
        super().__init__()
        self.attention = attention  # "repeat": K/V heads repeated to the query heads (gpt-fast); "gqa": SDPA's enable_gqa
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
        # k/v caches, one buffer per layer as gpt-fast keeps them: [bs, kv_heads, max_len, head_dim], filled
        # with random "prefill" keys. NOTE: one 5-D buffer indexed by layer made Inductor copy the whole
        # cache at every layer's write (the step grew with bs: 7.3 ms at bs 32 on an H100).
        shape = (bs, self.nkv, max_len, self.hd)
        for i in range(n):
            self.register_buffer(f"k_cache_{i}", torch.randn(shape, dtype=dtype, device=device) * 0.1, persistent=False)
            self.register_buffer(f"v_cache_{i}", torch.randn(shape, dtype=dtype, device=device) * 0.1, persistent=False)
        inv = 1.0 / (getattr(cfg, "rope_theta", 10000.0) ** (torch.arange(0, self.hd, 2, device=device).float() / self.hd))
        freqs = torch.outer(torch.arange(max_len, device=device).float(), inv)
        self.register_buffer("cos", freqs.cos().to(dtype), persistent=False)
        self.register_buffer("sin", freqs.sin().to(dtype), persistent=False)
        self.register_buffer("arange", torch.arange(max_len, device=device), persistent=False)

    def rms(self, x, i):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.norms[i]

    def rope(self, x, pos):  # x: [bs, heads, 1, hd]; rotate-half layout
        cos, sin = self.cos[pos].view(1, 1, 1, -1), self.sin[pos].view(1, 1, 1, -1)
        x1, x2 = x[..., : self.hd // 2], x[..., self.hd // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        bs = ids.shape[0]
        x = self.embed[ids]  # [bs, h]
        mask = (self.arange <= pos).view(1, 1, 1, -1)
        for i in range(len(self.qkv)):
            q, k, v = (self.rms(x, 2 * i) @ self.qkv[i].t()).split(
                [self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], dim=-1)
            q = self.rope(q.view(bs, self.nh, 1, self.hd), pos)
            k = self.rope(k.view(bs, self.nkv, 1, self.hd), pos)
            k_cache, v_cache = getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}")
            k_cache[:, :, pos] = k  # index_put in place, as gpt-fast's KVCache.update
            v_cache[:, :, pos] = v.view(bs, self.nkv, 1, self.hd)
            att = self.attend(q, k_cache, v_cache, mask)
            x = x + att.reshape(bs, -1) @ self.o[i].t()
            gate, up = (self.rms(x, 2 * i + 1) @ self.gate_up[i].t()).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ self.down[i].t()
        return (self.rms(x, -1) @ self.lm_head.t()).argmax(dim=-1)


    def attend(self, q, k, v, mask):
        group = self.nh // self.nkv
        if self.attention == "gqa" or group == 1:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=group > 1)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peer_step_ms(cfg, bs: int, context: int, steps: int, device, compile_: bool, attention: str = "repeat",
                 profile: bool = False) -> tuple[float, dict | None]:
    """(ms per step, and with `profile` the device kernels of one step: {"kernel_ms", "launches", "top_kernels"})."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = PeerLlama(cfg, bs, context + steps + 8, dtype, device, attention)
    torch._dynamo.reset()  # a fresh compile per peer: six model instances would pass Dynamo's recompile limit
    step = torch.compile(model, mode="reduce-overhead", fullgraph=True) if compile_ else model
    ids = torch.zeros(bs, dtype=torch.long, device=device)
    pos = torch.tensor([context], device=device)  # 1-D: a 0-d index is data-dependent to dynamo
    with torch.inference_mode():
        for _ in range(3):  # warm-up and capture
            ids = step(ids, pos).clone()
        sync(device)
        start = time.perf_counter()
        for i in range(steps):
            pos.fill_(context + i)  # NOTE: an in-place device write, no host sync
            ids = step(ids, pos).clone()
        sync(device)
    ms = (time.perf_counter() - start) * 1e3 / steps
    kernels = _peer_kernels(step, ids, pos, context, steps, device) if profile and device.type == "cuda" else None
    del model, step
    return ms, kernels


def _peer_kernels(step, ids, pos, context: int, steps: int, device) -> dict:
    """The peer's device kernels per step (torch.profiler over `steps` steps), beside the engine's profile."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            pos.fill_(context + i)
            ids = step(ids, pos).clone()
        sync(device)
    kernels = device_kernels(prof, steps)
    return {"kernel_ms": sum(k[1] for k in kernels), "launches": sum(k[2] for k in kernels), "top_kernels": kernels[:8]}


def set_overlap(engine: Engine, on: bool) -> None:
    """A fresh scheduler on the same runner (the engine's other settings kept)."""
    s = engine.scheduler
    engine.scheduler = Scheduler(s.runner, s.max_running, s.chunk_size, s.eos_token_ids, s.detokenize,
                                 participants=s.participants, overlap=on)


def engine_step_ms(engine: Engine, bs: int, context: int, steps: int) -> float:
    span = min(1000, engine.runner.hf_config.vocab_size - 3)  # ids 3.. inside every preset's vocabulary
    prompts = [[(7 * r + i) % span + 3 for i in range(context)] for r in range(bs)]

    def run(n):
        params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
        sync(engine.runner.device)
        t = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        sync(engine.runner.device)
        assert all(len(o.token_ids) == n for o in outs), [o.error for o in outs]
        return time.perf_counter() - t

    run(4)  # warm-up
    short, long = run(4), run(4 + steps)
    return (long - short) * 1e3 / steps


class _TimedGraph:
    """A captured graph whose replays record CUDA events around them (no host wait)."""

    def __init__(self, graph, events: list):
        self.graph, self.events = graph, events

    def replay(self) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.graph.replay()
        end.record()
        self.events.append((start, end))


def replay_ms(engine: Engine, bs: int, context: int, steps: int) -> float | None:
    """The median device time of one decode graph replay of `bs` requests, inside a real generate
    (CUDA events around each replay of the engine's own graphs; the host work around it excluded).
    None without graphs."""
    runner = engine.runner.graph_runner
    if runner is None or engine.runner.device.type != "cuda":
        return None
    events: list = []
    original = dict(runner.graphs)
    runner.graphs = {key: _TimedGraph(graph, events) for key, graph in original.items()}
    try:
        span = min(1000, engine.runner.hf_config.vocab_size - 3)
        prompts = [[(7 * r + i) % span + 3 for i in range(context)] for r in range(bs)]
        engine.generate(input_ids=prompts, sampling_params=SamplingParams(max_new_tokens=1 + steps, temperature=0.0,
                                                                          ignore_eos=True))
        sync(engine.runner.device)
    finally:
        runner.graphs = original
    times = sorted(start.elapsed_time(end) for start, end in events)
    return times[len(times) // 2] if times else None


def weight_floor_ms(engine: Engine, tb_s: float) -> float:
    """Bytes every decode step must read (all weights but the embedding table, unless tied) / bandwidth."""
    model = engine.runner.model
    embed = next((m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    params = {p.data_ptr(): p for p in model.parameters()}
    total = sum(p.numel() * p.element_size() for p in params.values())
    tied = bool(getattr(engine.runner.hf_config, "tie_word_embeddings", False))
    if embed is not None and not tied:
        total -= embed.numel() * embed.element_size()
    return total / (tb_s * 1e12) * 1e3


def _kernel_profile(engine: Engine, prompts, n: int) -> tuple[float, dict[str, tuple[float, int]], dict]:
    """(wall ms, {kernel: (device ms, launches)}, device_gaps) of one generate of n tokens under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.runner.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params=params)
        sync(engine.runner.device)
        wall = time.perf_counter() - t
    return wall * 1e3, {name: (ms, n) for name, ms, n in device_kernels(prof)}, device_gaps(prof)


def profile_step(engine: Engine, context: int, bs: int = 1, steps: int = 32) -> dict:
    """Where one decode step of `bs` requests spends its time, overlap on and off: wall time, device kernel time,
    the rest (host work the device waits for, and launch gaps), kernel launches, the top kernels.
    Decode only: a generate of 1 + steps tokens minus one of 1 token (the prefill cancels)."""
    span = min(1000, engine.runner.hf_config.vocab_size - 3)
    prompts = [[(7 * r + i) % span + 3 for i in range(context)] for r in range(bs)]
    report = {}
    for overlap in (True, False):
        set_overlap(engine, overlap)
        _kernel_profile(engine, prompts, 1 + steps)  # warm-up
        short_wall, short, short_gaps = _kernel_profile(engine, prompts, 1)
        long_wall, long, long_gaps = _kernel_profile(engine, prompts, 1 + steps)
        per = _per_step(long, short, steps)
        gaps = sorted(_per_step(long_gaps, short_gaps, steps).items(), key=lambda kv: -kv[1][0])[:6]
        wall, device = (long_wall - short_wall) / steps, sum(ms for ms, _ in per.values())
        top = sorted(per.items(), key=lambda kv: -kv[1][0])[:8]
        report["overlap" if overlap else "no_overlap"] = {
            "wall_ms": wall, "kernel_ms": device, "host_or_gap_ms": wall - device,
            "launches": sum(n for _, n in per.values()), "top_kernels": [(k[:70], ms, n) for k, (ms, n) in top],
            "top_gaps": [(k, ms, n) for k, (ms, n) in gaps]}
    set_overlap(engine, True)
    return report


def _per_step(long: dict, short: dict, steps: int) -> dict[str, tuple[float, float]]:
    """{name: (ms, count)} of the long run minus the short one, per decode step."""
    return {k: ((ms - short.get(k, (0.0, 0))[0]) / steps, (n - short.get(k, (0.0, 0))[1]) / steps)
            for k, (ms, n) in long.items()}


def host_functions(engine: Engine, context: int, bs: int, steps: int = 32, top: int = 30) -> dict[str, list]:
    """The host's own time per decode step by function, overlap off (cProfile over a generate of
    1 + steps tokens, divided by steps; prefill included): rows (function, self ms, cumulative ms),
    the `top` by cumulative time ("cumulative": a backend's per-step plan, the scheduler, the
    sampler) and by self time ("self": where the Python itself goes)."""
    import cProfile
    import pstats

    span = min(1000, engine.runner.hf_config.vocab_size - 3)
    prompts = [[(7 * r + i) % span + 3 for i in range(context)] for r in range(bs)]
    set_overlap(engine, False)
    params = SamplingParams(max_new_tokens=1 + steps, temperature=0.0, ignore_eos=True)
    profiler = cProfile.Profile()
    profiler.enable()
    engine.generate(input_ids=prompts, sampling_params=params)
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, prim calls, self s, cum s, callers)
    rows = [(f"{path.rsplit('/', 2)[-1] if '/' in path else path}:{name}", tt * 1e3 / steps, ct * 1e3 / steps)
            for (path, _, name), (_, _, tt, ct, _) in stats.items() if "generate" not in name]
    set_overlap(engine, True)
    return {"cumulative": sorted(rows, key=lambda r: -r[2])[:top], "self": sorted(rows, key=lambda r: -r[1])[:top]}


PEER_MS: dict[tuple[str, int, str], float] = {}  # (model, bs, attention) -> peer step ms, shared by the backends
PEER_PROFILE: dict[tuple[str, int, str], dict | None] = {}  # the same keys -> the peer's kernels per step


def measure_model(ns, model: str, backend: str) -> list[dict]:
    device = torch.device(ns.device)
    engine = Engine(model, device=ns.device, attention_backend=backend, max_running_requests=max(ns.batch_sizes),
                    max_total_tokens=max(ns.batch_sizes) * (ns.context + ns.steps + 64),
                    cuda_graph_bs=ns.batch_sizes, chunked_prefill_size=max(8192, ns.context))
    cfg, floor = engine.runner.hf_config, weight_floor_ms(engine, ns.hbm_tb_s)
    rows = []
    for bs in ns.batch_sizes:
        row = {"model": model, "backend": backend, "batch_size": bs, "floor_ms": floor}
        for on in (True, False):
            set_overlap(engine, on)
            row["engine_ms" if on else "engine_no_overlap_ms"] = engine_step_ms(engine, bs, ns.context, ns.steps)
        row["replay_ms"] = replay_ms(engine, bs, ns.context, ns.steps)
        row["profile"] = profile_step(engine, ns.context, bs) if bs in ns.profile else None
        row["host_functions"] = host_functions(engine, ns.context, bs) if bs in ns.profile else None
        set_overlap(engine, True)
        rows.append(row)
        replay = "-" if row["replay_ms"] is None else f"{row['replay_ms']:.3f}"
        print(f"engine {model} {backend} bs {bs}: {row['engine_ms']:.3f} ms (overlap off {row['engine_no_overlap_ms']:.3f}, "
              f"replay {replay}, floor {floor:.3f})", flush=True)  # a cut-off run still shows these
    engine.shutdown()
    del engine
    gc.collect()
    torch.cuda.empty_cache() if device.type == "cuda" else None
    for row in rows:  # the peer after the engine is gone: both never hold memory at once
        variants = {}
        for attention in ns.peer_attention:
            key = (model, row["batch_size"], attention)
            if key not in PEER_MS:
                PEER_MS[key], PEER_PROFILE[key] = peer_step_ms(
                    cfg, row["batch_size"], ns.context, ns.steps, device, not ns.no_compile, attention,
                    profile=row["batch_size"] in ns.profile)
                print(f"peer {model} bs {row['batch_size']} {attention}: {PEER_MS[key]:.3f} ms", flush=True)
            variants[attention] = PEER_MS[key]
        row["peer_variants_ms"] = variants
        fastest = min(variants, key=variants.get)
        row["peer_profile"] = PEER_PROFILE.get((model, row["batch_size"], fastest))
        row["peer_ms"] = min(variants.values())  # the engine is compared with the faster peer
        row["ratio"] = row["engine_ms"] / row["peer_ms"]
        row["overlap_speedup"] = row["engine_no_overlap_ms"] / row["engine_ms"]
        gc.collect()
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'model':<14} {'backend':<12} {'bs':>3} {'peer ms':>8} {'engine ms':>9} {'ratio':>6} "
             f"{'no-overlap':>10} {'overlap x':>9} {'floor ms':>8} {'replay ms':>9} {'replay/floor':>12}"]
    for r in rows:
        replay = r.get("replay_ms")
        replay_cols = f"{replay:>9.3f} {replay / r['floor_ms']:>12.2f}" if replay else f"{'-':>9} {'-':>12}"
        lines.append(f"{r['model']:<14} {r['backend']:<12} {r['batch_size']:>3} {r['peer_ms']:>8.3f} "
                     f"{r['engine_ms']:>9.3f} {r['ratio']:>6.2f} {r['engine_no_overlap_ms']:>10.3f} "
                     f"{r['overlap_speedup']:>9.2f} {r['floor_ms']:>8.3f} {replay_cols}")
    for r in rows:
        p = r.get("profile")
        if not p:
            continue
        lines.append(f"{r['model']} {r['backend']}, one bs-{r['batch_size']} decode step (profiler): wall ms | kernels ms | "
                     "host or gaps ms | launches")
        for name, q in p.items():
            lines.append(f"  {name:<11} {q['wall_ms']:7.3f} {q['kernel_ms']:7.3f} {q['host_or_gap_ms']:7.3f} "
                         f"{q['launches']:6.0f}")
        lines.append("  top kernels (overlap): " + "; ".join(f"{k[:40]} {ms:.3f} ms x{n:.0f}"
                                                        for k, ms, n in p["overlap"]["top_kernels"][:5]))
        lines.append("  device idle before (overlap): " + "; ".join(
            f"{k} {ms:.3f} ms x{n:.0f}" for k, ms, n in p["overlap"]["top_gaps"][:4]))
        peer = r.get("peer_profile")
        if peer:
            lines.append(f"  peer: kernels {peer['kernel_ms']:.3f} ms, {peer['launches']:.0f} launches; top: " + "; ".join(
                f"{k[:40]} {ms:.3f} ms x{n:.0f}" for k, ms, n in peer["top_kernels"][:6]))
        lines.append("  host self ms per step (overlap off): " + "; ".join(
            f"{name[:40]} {own:.3f}" for name, own, _ in r["host_functions"]["self"][:8]))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["llama-3.2-1b", "llama-3.1-8b"])
    p.add_argument("--backends", nargs="+", default=["triton", "flashinfer"])
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--device", default="cuda")
    p.add_argument("--hbm-tb-s", type=float, default=None,
                   help="memory bandwidth for the weight-read floor, TB/s (default: a measured device copy)")
    p.add_argument("--no-compile", action="store_true", help="run the peer eagerly (CPU smoke runs)")
    p.add_argument("--peer-attention", nargs="+", choices=["repeat", "gqa"], default=["repeat", "gqa"],
                   help="the peer's attention: K/V heads repeated to the query heads (gpt-fast) and/or SDPA's "
                        "enable_gqa; with both, the faster peer is the one compared")
    p.add_argument("--profile", type=int, nargs="*", default=None, metavar="BS",
                   help="profile one engine step at these batch sizes (bare --profile: 1 and 32)")
    p.add_argument("--out")
    ns = p.parse_args()
    get_preset(ns.models[0])  # fail fast on a misspelt preset
    ns.hbm_tb_s = ns.hbm_tb_s or copy_bandwidth_tb_s(ns.device)
    ns.profile = [] if ns.profile is None else (ns.profile or [1, 32])
    print(f"device copy bandwidth {ns.hbm_tb_s:.2f} TB/s (the weight-read floor's)")
    rows = []
    for model in ns.models:
        for backend in ns.backends:
            rows += measure_model(ns, model, backend)
            if ns.out:  # after each backend, so that a run cut off by a time limit keeps what it finished
                with open(ns.out, "w") as f:
                    json.dump(rows, f, indent=2)
    print(table(rows))


if __name__ == "__main__":
    main()
