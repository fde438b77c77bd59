"""The LoRA kernels of one layer at decode sizes against their read floor (the bytes of the batch's
adapters' A and B at the card's copy bandwidth): the fused shrink-and-expand kernel (warm and L2-cold,
with the tuned table and with the read model's launches), the segmented kernels, and the folded
path's LoRA share (its GEMM over [W; A] and the expand, less the base GEMM, cold). Each result is
checked against torch_native first: a fast wrong kernel is no result. --tune times every launch
setting of the fused kernel instead and writes the fastest as the plugin's tuned table.

Shapes from a model preset; bf16 on CUDA, float32 on CPU (TRITON_INTERPRET=1: the code path only).

    python -m bench.lora_kernels --model llama-3.2-1b --ranks 16 64 --tokens 1 8 32 64
    python -m bench.lora_kernels --tune lora_triton_configs.json     # then copy to plugins/lora_triton/configs/<GPU>.json
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
from pathlib import Path

import torch

from bench import report
from bench.timing import copy_tb_s, time_us
from bench.workload import projection_shapes

TARGET_VS_FLOOR = 4.0
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
COLUMNS = [("T", "tokens", "d"), ("rank", "rank", "d"), ("fused", "fused_us", ".2f"), ("cold", "fused_cold_us", ".2f"),
           ("read model", "fused_automatic_us", ".2f"), ("segmented", "segmented_us", ".2f"),
           ("cold", "segmented_cold_us", ".2f"), ("floor", "floor_us", ".2f"), ("fused/floor", "fused_vs_floor", ".1f"),
           ("folded", "folded_cold_us", ".2f"), ("folded/floor", "folded_vs_floor", ".1f"), ("verdict", "verdict", "")]


class Group:
    """One projection group's stacked weights (every slot at `rank`, slot 0 empty), input and output."""

    def __init__(self, k: int, widths: list[int], tokens: int, num_slots: int, rank: int, device, dtype):
        self.widths, self.offsets = widths, [0, *itertools.accumulate(widths)]
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
        return torch.nn.functional.linear(self.x, self.w_ext[: self.offsets[-1]])

    def folded(self, backend) -> torch.Tensor:
        """The folded path: the GEMM over [W; A], then the backend's expand into a fresh output."""
        y = torch.nn.functional.linear(self.x, self.w_ext)
        return backend.expand_folded(y, self.offsets[-1], self.b, self.offsets, torch.empty_like(self.out))

    def bytes_per_adapter(self) -> int:
        return (self.a[0].numel() + self.b[0].numel()) * self.a.element_size()


def _setup(model: str, rank: int, tokens: int, num_adapters: int, device: torch.device):
    """(batch info, backend context, groups, distinct adapters) of a decode batch: token i on adapter i mod N."""
    from backplane.lora import LoraBackendContext, LoraBatchInfo
    from backplane.models.presets import get_preset

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    slots = [1 + i % num_adapters for i in range(tokens)]
    info = LoraBatchInfo.from_segments([1] * tokens, slots, [0] + [rank] * num_adapters,
                                       [0.0] + [2.0] * num_adapters, device)
    ctx = LoraBackendContext(device=device, dtype=dtype, max_loras_per_batch=num_adapters, max_lora_rank=rank,
                             max_bs=tokens, max_num_tokens=max(tokens, 256))
    shapes = projection_shapes(get_preset(model))  # (K, output widths of the slices) of each group
    groups = {name: Group(shapes[p[0]][0], [shapes[q][1] for q in p], tokens, num_adapters + 1, rank, device, dtype)
              for name, p in GROUPS.items()}
    return info, ctx, groups, len(set(slots))


def _backend(ctx, info, configs: str | None = None, use_table: bool = True, **tuning):
    """A triton backend prepared for `info`; use_table=False ignores the tuned table (the read model decides)."""
    from backplane.plugins.lora_triton.backend import TritonLoraBackend, Tuning
    from backplane.plugins.lora_triton.options import TritonLoraOptions

    options = TritonLoraOptions(configs=configs, tuned=use_table)
    backend = TritonLoraBackend(dataclasses.replace(ctx, options=options), Tuning(**tuning))
    backend.prepare_batch(info)
    return backend


def _native(ctx, info):
    from backplane.lora.torch_native import TorchNativeLoraBackend

    native = TorchNativeLoraBackend(ctx)
    native.prepare_batch(info)
    return native


def _reference(group: Group, ctx, info) -> tuple[torch.Tensor, torch.Tensor]:
    """(base output, torch_native's LoRA on it)."""
    base = torch.randn_like(group.out)
    group.out.copy_(base)
    return base, group.lora(_native(ctx, info)).float().clone()


def _check_against(group: Group, backend, reference: tuple[torch.Tensor, torch.Tensor]) -> None:
    base, want = reference
    group.out.copy_(base)
    torch.testing.assert_close(group.lora(backend).float(), want, atol=5e-2, rtol=2e-2)


def kernel_report(model: str, rank: int, tokens: int, num_adapters: int, device: torch.device,
                  configs: str | None = None) -> dict:
    """One layer's LoRA at `tokens` decode tokens, per group and in total, in µs."""
    info, ctx, groups, distinct = _setup(model, rank, tokens, num_adapters, device)
    fused, segmented = _backend(ctx, info, configs), _backend(ctx, info, configs, fused_max_tokens=0)
    automatic = _backend(ctx, info, use_table=False)
    per_group = {}
    for name, g in groups.items():
        _check_against(g, fused, _reference(g, ctx, info))
        want = _native(ctx, info).apply_lora(g.x, g.a, g.b, g.offsets, g.base().clone()).float()  # base GEMM + LoRA
        torch.testing.assert_close(g.folded(fused).float(), want, atol=5e-2, rtol=2e-2)
        base_cold = time_us(g.base, device, cold=True)
        per_group[name] = {
            "fused_us": time_us(lambda g=g: g.lora(fused), device),
            "fused_cold_us": time_us(lambda g=g: g.lora(fused), device, cold=True),
            "fused_automatic_us": time_us(lambda g=g: g.lora(automatic), device),
            "segmented_us": time_us(lambda g=g: g.lora(segmented), device),
            "segmented_cold_us": time_us(lambda g=g: g.lora(segmented), device, cold=True),
            "folded_cold_us": time_us(lambda g=g: g.folded(fused), device, cold=True) - base_cold,
            "base_gemm_cold_us": base_cold, "tuned": len(fused.tuned) > 0,
            "floor_us": g.bytes_per_adapter() * distinct / copy_tb_s(device.type) / 1e6}
    totals = {k: sum(g[k] for g in per_group.values()) for k in per_group["qkv"] if k != "tuned"}
    # the cold figures against the floor: the floor reads from HBM, as a model step's LoRA kernels do
    return {"rank": rank, "tokens": tokens, "distinct_adapters": distinct, **totals, "groups": per_group,
            "fused_vs_floor": totals["fused_cold_us"] / totals["floor_us"],
            "folded_vs_floor": totals["folded_cold_us"] / totals["floor_us"]}


def tune_fused(model: str, ranks: list[int], token_counts: list[int], num_adapters: int, device: torch.device,
               spans=(128, 256, 512, 1024, 2048), splits=(1, 2, 4, 8, 16), warps=(2, 4, 8)) -> dict:
    """Every launch setting the fused kernel's buffers allow, per projection group, rank and token
    count, each checked against torch_native and timed L2-cold (a latency-bound kernel ranks
    differently on warm L2); the fastest kept. Returns the tuned table (plugins/lora_triton/tuned.py's
    JSON), the automatic setting's time beside each entry."""
    import triton

    from backplane.plugins.lora_triton.fused import FusedConfig, tile_sizes

    entries = []
    for rank, tokens in itertools.product(ranks, token_counts):
        info, ctx, groups, _ = _setup(model, rank, tokens, num_adapters, device)
        auto = _backend(ctx, info, fused_config=FusedConfig(), use_table=False)
        for name, group in groups.items():
            k, widths, want, timed = group.x.shape[1], group.widths, _reference(group, ctx, info), []
            for config in _fused_configs(k, widths, spans, splits, warps):
                backend = _backend(ctx, info, fused_config=config)
                _check_against(group, backend, want)
                timed.append((time_us(lambda g=group, b=backend: g.lora(b), device, cold=True), config))
            (us, config), (block_t, block_r) = min(timed, key=lambda t: t[0]), tile_sizes(tokens, rank)
            entries.append({"group": name, "tokens": tokens, "rank": rank, "k": k, "widths": widths,
                            "block_r": block_r, "block_t": block_t, "span": config.span, "split_k": config.split_k,
                            "num_warps": config.num_warps, "us": us,
                            "automatic_us": time_us(lambda g=group, b=auto: g.lora(b), device, cold=True)})
    return {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "triton": triton.__version__,
            "dtype": str(groups["qkv"].x.dtype).removeprefix("torch."), "model": model, "adapters": num_adapters,
            "entries": _one_per_bucket(entries)}


def _fused_configs(k: int, widths: list[int], spans, splits, warps):
    """Every FusedConfig the fused kernel's buffers allow for a group of K `k` and these slice widths."""
    import triton

    from backplane.plugins.lora_triton.fused import MAX_GROUPS, MIN_SPLIT_K, FusedConfig

    for split_k, span, num_warps in itertools.product(splits, spans, warps):
        tiles = split_k * sum(triton.cdiv(w, span) for w in widths)
        if split_k == 1 or (k // split_k >= MIN_SPLIT_K and tiles <= MAX_GROUPS):
            yield FusedConfig(span=span, split_k=split_k, num_warps=num_warps)


def _one_per_bucket(entries: list[dict]) -> list[dict]:
    """Token counts that pad to one block_t share a table entry: keep the one measured at the most
    tokens (the bucket's worst case)."""
    kept: dict[tuple, dict] = {}
    for e in sorted(entries, key=lambda e: e["tokens"]):  # stable: the most tokens come last and stay
        kept[(e["k"], tuple(e["widths"]), e["block_r"], e["block_t"])] = e
    return list(kept.values())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = report.parser(__doc__)
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--configs", metavar="TABLE.json", help="the tuned table to time with (default: the plugin's for this GPU)")
    p.add_argument("--tune", metavar="TABLE.json", help="first tune the fused kernel at --ranks x --tokens, write the "
                                                        "table here, then time the kernels with it")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    ns = parse_args(argv)
    device = torch.device(ns.device)
    torch.manual_seed(0)
    if ns.tune:
        Path(ns.tune).write_text(json.dumps(tune_fused(ns.model, ns.ranks, sorted(ns.tokens), ns.adapters, device), indent=1))
        ns.configs = ns.tune
    rows = [kernel_report(ns.model, r, t, ns.adapters, device, ns.configs) for r in ns.ranks for t in ns.tokens]
    for row in rows:
        row["verdict"] = ", ".join(f"{k} {report.verdict(row[f'{k}_vs_floor'], TARGET_VS_FLOOR)}" for k in ("fused", "folded"))
    report.write_result("lora-kernels", ns.model, {"args": vars(ns), "rows": rows}, ns.out, ns.device)
    print(report.table(rows, COLUMNS, f"{ns.model}: one layer's LoRA, µs; verdicts: <= {TARGET_VS_FLOOR}x the floor"))
    return rows


if __name__ == "__main__":
    main()
