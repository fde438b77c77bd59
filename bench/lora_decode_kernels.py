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
from timing import time_graph  # noqa: E402  (bench/timing.py)

PEAK_BYTES_PER_S = 4.30e12  # measured device-to-device copy on the H200 machine


def group_shapes(model: str) -> dict[str, tuple[int, list[int]]]:
    """name -> (K, output widths of the slices) of the four projection groups of a preset."""
    from backplane.models.config_utils import head_dim_of, num_kv_heads_of
    from backplane.models.presets import get_preset

    c = get_preset(model)
    q, kv = c.num_attention_heads * head_dim_of(c), num_kv_heads_of(c) * head_dim_of(c)
    return {"qkv": (c.hidden_size, [q, kv, kv]), "o": (q, [c.hidden_size]),
            "gate_up": (c.hidden_size, [c.intermediate_size] * 2), "down": (c.intermediate_size, [c.hidden_size])}


def time_us(fn, device: torch.device, reps_in_graph: int = 20, replays: int = 30) -> float:
    if device.type != "cuda":
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    return time_graph(fn, reps_in_graph, replays)


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

    def lora(self, backend) -> torch.Tensor:
        return backend.apply_lora(self.x, self.a, self.b, self.offsets, self.out)

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


def _backend(ctx, info, **tuning):
    from backplane.plugins.lora_triton.backend import TritonLoraBackend, Tuning

    backend = TritonLoraBackend(ctx, Tuning(**tuning))
    backend.prepare_batch(info)
    return backend


def _check(group: Group, backend, ctx, info) -> None:
    """The fused result against torch_native (bf16 tolerance): a fast wrong kernel is no result."""
    from backplane.lora.torch_native import TorchNativeLoraBackend

    native = TorchNativeLoraBackend(ctx)
    native.prepare_batch(info)
    base = torch.randn_like(group.out)
    group.out.copy_(base)
    want = group.lora(native).float().clone()
    group.out.copy_(base)
    got = group.lora(backend).float()
    torch.testing.assert_close(got, want, atol=5e-2, rtol=2e-2)


def kernel_report(model: str, rank: int, tokens: int, num_adapters: int, device: torch.device) -> dict:
    """Per layer at `tokens` decode tokens: fused and segmented LoRA time, the read floor, per group."""
    info, ctx, groups, distinct = _setup(model, rank, tokens, num_adapters, device)
    fused, segmented = _backend(ctx, info), _backend(ctx, info, fused_max_tokens=0)
    per_group = {}
    for name, group in groups.items():
        _check(group, fused, ctx, info)
        per_group[name] = {"fused_us": time_us(lambda g=group: g.lora(fused), device),
                           "segmented_us": time_us(lambda g=group: g.lora(segmented), device),
                           "floor_us": group.bytes_per_adapter() * distinct / PEAK_BYTES_PER_S * 1e6}
    totals = {key: sum(g[key] for g in per_group.values()) for key in ("fused_us", "segmented_us", "floor_us")}
    layer_graph = time_us(lambda: [g.lora(fused) for g in groups.values()], device)
    return {"rank": rank, "tokens": tokens, "distinct_adapters": distinct, **totals,
            "fused_vs_floor": totals["fused_us"] / totals["floor_us"], "layer_graph_us": layer_graph,
            "groups": per_group}


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
