"""The kernel half of bench/lora_decode.py: one layer's LoRA at decode sizes, fused vs segmented.

Shapes come from a model preset; 16-bit weights on CUDA (bf16), float32 on CPU (the interpreter).
Timing: median per call over replays of a CUDA graph holding 20 calls (so launch gaps count, as in
a decode graph); on CPU one wall-clock call (only the code path is exercised there).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import peak_bytes_per_s, time_graph  # noqa: E402  (bench/timing.py)

TUNED_CONFIGS: list[str | None] = [None]  # the table the kernel timings use (None: the bundled one, if any)


def group_shapes(model: str) -> dict[str, tuple[int, list[int]]]:
    """name -> (K, output widths of the slices) of the four projection groups of a preset."""
    from backplane.models.config_utils import head_dim_of, num_kv_heads_of
    from backplane.models.presets import get_preset

    c = get_preset(model)
    q, kv = c.num_attention_heads * head_dim_of(c), num_kv_heads_of(c) * head_dim_of(c)
    return {"qkv": (c.hidden_size, [q, kv, kv]), "o": (q, [c.hidden_size]),
            "gate_up": (c.hidden_size, [c.intermediate_size] * 2), "down": (c.intermediate_size, [c.hidden_size])}


def time_us(fn, device: torch.device, reps_in_graph: int = 20, replays: int = 30, cold: bool = False) -> float:
    """Microseconds of one fn(): in a CUDA graph on CUDA (cold: L2 flushed before each call, as in a
    model step where the adapters' weights are not in L2), one host-timed call elsewhere."""
    if device.type != "cuda":
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    return time_graph(fn, reps_in_graph, replays, cold=cold)


class Group:
    """One projection group's stacked weights (every slot at `rank`), input and base output."""

    def __init__(self, k: int, widths: list[int], tokens: int, num_slots: int, rank: int, device, dtype):
        self.offsets = [0]
        for width in widths:
            self.offsets.append(self.offsets[-1] + width)
        dt = dict(device=device, dtype=dtype)
        self.x = torch.randn(tokens, k, **dt)
        self.a = torch.randn(num_slots, len(widths) * rank, k, **dt) / k**0.5
        self.b = torch.randn(num_slots, self.offsets[-1], rank, **dt) / rank**0.5
        self.a[0], self.b[0] = 0, 0
        self.out = torch.zeros(tokens, self.offsets[-1], **dt)
        # the folded path's buffer [W; A] (--triton-lora.decode-path folded), with a random base weight
        self.w_ext = torch.cat([torch.randn(self.offsets[-1], k, **dt) / k**0.5, self.a.reshape(-1, k)])

    def lora(self, backend) -> torch.Tensor:
        return backend.apply_lora(self.x, self.a, self.b, self.offsets, self.out)

    def base(self) -> torch.Tensor:
        """The base GEMM alone (what the folded path's LoRA cost is measured above)."""
        return torch.nn.functional.linear(self.x, self.w_ext[: self.offsets[-1]])

    def folded(self, backend) -> torch.Tensor:
        """The folded path: the GEMM over [W; A], then the backend's expand into a fresh output."""
        y = torch.nn.functional.linear(self.x, self.w_ext)
        return backend.expand_folded(y, self.offsets[-1], self.b, self.offsets, torch.empty_like(self.out))

    def bytes_per_adapter(self) -> int:
        return (self.a[0].numel() + self.b[0].numel()) * self.a.element_size()


def _setup(model: str, rank: int, tokens: int, num_adapters: int, device: torch.device):
    from backplane.lora.base import LoraBackendContext
    from backplane.lora.batch_info import LoraBatchInfo

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    slots = [1 + i % num_adapters for i in range(tokens)]
    info = LoraBatchInfo.from_segments([1] * tokens, slots, [0] + [rank] * num_adapters,
                                       [0.0] + [2.0] * num_adapters, device)
    ctx = LoraBackendContext(device=device, dtype=dtype, max_loras_per_batch=num_adapters, max_lora_rank=rank,
                             max_bs=tokens, max_num_tokens=max(tokens, 256))
    groups = {name: Group(k, widths, tokens, num_adapters + 1, rank, device, dtype)
              for name, (k, widths) in group_shapes(model).items()}
    return info, ctx, groups, len(set(slots))


def _backend(ctx, info, use_table: bool = True, **tuning):
    """A triton backend for `info`; use_table=False ignores the tuned table (the read model decides)."""
    import dataclasses

    from backplane.plugins.lora_triton.backend import TritonLoraBackend, Tuning
    from backplane.plugins.lora_triton.options import TritonLoraOptions

    options = TritonLoraOptions(configs=TUNED_CONFIGS[0], tuned=use_table)
    backend = TritonLoraBackend(dataclasses.replace(ctx, options=options), Tuning(**tuning))
    backend.prepare_batch(info)
    return backend


def _reference(group: Group, ctx, info) -> tuple[torch.Tensor, torch.Tensor]:
    """(base output, torch_native's result on it) for `group`."""
    from backplane.lora.torch_native import TorchNativeLoraBackend

    native = TorchNativeLoraBackend(ctx)
    native.prepare_batch(info)
    base = torch.randn_like(group.out)
    group.out.copy_(base)
    return base, group.lora(native).float().clone()


def _check_against(group: Group, backend, reference: tuple[torch.Tensor, torch.Tensor]) -> None:
    """The backend's result against torch_native's (bf16 tolerance): a fast wrong kernel is no result."""
    base, want = reference
    group.out.copy_(base)
    got = group.lora(backend).float()
    torch.testing.assert_close(got, want, atol=5e-2, rtol=2e-2)


def _check(group: Group, backend, ctx, info) -> None:
    _check_against(group, backend, _reference(group, ctx, info))


def _check_folded(group: Group, backend, ctx, info) -> None:
    """The folded path's output against the base GEMM plus torch_native's LoRA (bf16 tolerance)."""
    from backplane.lora.torch_native import TorchNativeLoraBackend

    native = TorchNativeLoraBackend(ctx)
    native.prepare_batch(info)
    want = native.apply_lora(group.x, group.a, group.b, group.offsets, group.base().clone()).float()
    torch.testing.assert_close(group.folded(backend).float(), want, atol=5e-2, rtol=2e-2)


def kernel_report(model: str, rank: int, tokens: int, num_adapters: int, device: torch.device) -> dict:
    """Per layer at `tokens` decode tokens: fused and segmented LoRA time, the read floor, per group."""
    info, ctx, groups, distinct = _setup(model, rank, tokens, num_adapters, device)
    fused, segmented = _backend(ctx, info), _backend(ctx, info, fused_max_tokens=0)
    automatic = _backend(ctx, info, use_table=False)  # the read model's launches, for comparison
    per_group = {}
    for name, group in groups.items():
        _check(group, fused, ctx, info)
        per_group[name] = {"fused_us": time_us(lambda g=group: g.lora(fused), device),
                           "fused_cold_us": time_us(lambda g=group: g.lora(fused), device, cold=True),
                           "segmented_cold_us": time_us(lambda g=group: g.lora(segmented), device, cold=True),
                           "fused_automatic_us": time_us(lambda g=group: g.lora(automatic), device),
                           "segmented_us": time_us(lambda g=group: g.lora(segmented), device),
                           "floor_us": group.bytes_per_adapter() * distinct / peak_bytes_per_s(device.type) * 1e6,
                           "tuned": len(fused.tuned) > 0}
        _check_folded(group, fused, ctx, info)
        base_cold = time_us(group.base, device, cold=True)
        per_group[name].update({  # the folded path's LoRA share: its GEMM and expand, less the base GEMM
            "folded_cold_us": time_us(lambda g=group: g.folded(fused), device, cold=True) - base_cold,
            "base_gemm_cold_us": base_cold})
    keys = ("fused_us", "fused_cold_us", "fused_automatic_us", "segmented_us", "segmented_cold_us", "floor_us",
            "folded_cold_us", "base_gemm_cold_us")
    totals = {key: sum(g[key] for g in per_group.values()) for key in keys}
    layer_graph = time_us(lambda: [g.lora(fused) for g in groups.values()], device)
    return {"rank": rank, "tokens": tokens, "distinct_adapters": distinct, **totals,
            # the cold figure: the floor reads from HBM, as a model step's LoRA kernels do
            "fused_vs_floor": totals["fused_cold_us"] / totals["floor_us"], "layer_graph_us": layer_graph,
            "folded_vs_floor": totals["folded_cold_us"] / totals["floor_us"],
            "groups": per_group}


def tune_fused(model: str, ranks: list[int], token_counts: list[int], num_adapters: int, device: torch.device,
               spans=(128, 256, 512, 1024, 2048), splits=(1, 2, 4, 8, 16), warps=(2, 4, 8)) -> dict:
    """Every launch setting the fused kernel's buffers allow, per projection group, rank and token
    count: each result checked against torch_native, the fastest kept, timed with L2 flushed before
    every call (`cold`: in a model step the adapters' weights come from HBM, and a latency-bound
    kernel ranks differently on warm L2). Returns the tuned table (plugins/lora_triton/tuned.py's
    JSON) with the automatic setting's time beside each entry."""
    import triton

    from backplane.plugins.lora_triton.fused import MAX_GROUPS, MIN_SPLIT_K, FusedConfig, tile_sizes

    entries = []
    for rank in ranks:
        for tokens in token_counts:
            info, ctx, groups, _ = _setup(model, rank, tokens, num_adapters, device)
            auto = _backend(ctx, info, fused_config=FusedConfig(), use_table=False)
            for name, group in groups.items():
                k, widths = group.x.shape[1], [hi - lo for lo, hi in zip(group.offsets, group.offsets[1:])]
                want = _reference(group, ctx, info)
                best = None
                for split_k in splits:
                    if split_k > 1 and k // split_k < MIN_SPLIT_K:
                        continue
                    for span in spans:
                        if split_k > 1 and split_k * sum(triton.cdiv(w, span) for w in widths) > MAX_GROUPS:
                            continue
                        for num_warps in warps:
                            config = FusedConfig(span=span, split_k=split_k, num_warps=num_warps)
                            backend = _backend(ctx, info, fused_config=config)
                            _check_against(group, backend, want)
                            us = time_us(lambda g=group, b=backend: g.lora(b), device, cold=True)
                            if best is None or us < best[0]:
                                best = (us, config)
                auto_us = time_us(lambda g=group, b=auto: g.lora(b), device, cold=True)
                block_t, block_r = tile_sizes(tokens, rank)
                us, config = best
                entries.append({"group": name, "tokens": tokens, "rank": rank, "k": k, "widths": widths,
                                "block_r": block_r, "block_t": block_t, "span": config.span,
                                "split_k": config.split_k, "num_warps": config.num_warps, "us": us,
                                "automatic_us": auto_us})
                print(f"tune: {name:<7} T {tokens:>2} rank {rank:>2}: span {config.span:>4} split_k {config.split_k:>2} "
                      f"warps {config.num_warps} {us:7.2f} us (automatic {auto_us:7.2f} us)", flush=True)
    return {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "triton": triton.__version__, "dtype": str(groups["qkv"].x.dtype).removeprefix("torch."),
            "model": model, "adapters": num_adapters, "entries": _one_per_bucket(entries)}


def _one_per_bucket(entries: list[dict]) -> list[dict]:
    """Token counts that pad to one block_t share a table entry: keep the one measured at the most
    tokens (the bucket's worst case)."""
    kept: dict[tuple, dict] = {}
    for e in entries:
        key = (e["k"], tuple(e["widths"]), e["block_r"], e["block_t"])
        if key not in kept or e["tokens"] > kept[key]["tokens"]:
            kept[key] = e
    return list(kept.values())


def sweep_fused(model: str, rank: int, tokens: int, num_adapters: int, device: torch.device) -> list[dict]:
    """Per-layer fused time for a few launch settings besides the automatic one (span, split_k;
    0: automatic). A setting that needs more programs than the kernel's buffers hold is skipped."""
    from backplane.plugins.lora_triton.fused import FusedConfig

    info, ctx, groups, _ = _setup(model, rank, tokens, num_adapters, device)
    rows = []
    for span, split_k in ((0, 1), (512, 0), (256, 4), (0, 16)):
        config = FusedConfig(span=span, split_k=split_k)
        backend = _backend(ctx, info, fused_config=config)
        try:
            _check(groups["qkv"], backend, ctx, info)
            us = sum(time_us(lambda g=g, b=backend: g.lora(b), device) for g in groups.values())
        except ValueError as exc:
            print(f"sweep: span={span} split_k={split_k} skipped ({exc})")
            continue
        rows.append({"tokens": tokens, "rank": rank, "config": f"span={span or 'auto'} split_k={split_k or 'auto'}",
                     "fused_us": us})
    return rows
