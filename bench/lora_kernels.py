"""Benchmark of the Triton LoRA kernels on the decode shape of Llama-3.2-1B (GPU only).

Per layer: shrink + expand of the fused q,k,v, o, the fused gate,up and down projections, for T=32
tokens on 8 distinct rank-16 adapters (4 requests each), timed inside CUDA graphs (median over
replays, CUDA events), against the bandwidth floor of reading those adapters' A and B and against the
base GEMMs of the same projections at T=32. Also sweeps a few launch settings.

    python bench/lora_kernels.py --out lora_kernels.json
"""

from __future__ import annotations

import argparse
import sys
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from backplane.lora.base import LoraBackendContext
from backplane.lora.batch_info import LoraBatchInfo
from backplane.lora.torch_native import TorchNativeLoraBackend

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import peak_bytes_per_s, time_graph  # noqa: E402  (bench/timing.py)

HIDDEN, INTER, N_Q, N_KV = 2048, 8192, 32 * 64, 8 * 64
NUM_LAYERS = 16
DEVICE, DTYPE = "cuda", torch.bfloat16
# name: (K, output widths of the slices)
PROJECTIONS = {
    "qkv": (HIDDEN, (N_Q, N_KV, N_KV)),
    "o": (HIDDEN, (HIDDEN,)),
    "gate_up": (HIDDEN, (INTER, INTER)),
    "down": (INTER, (HIDDEN,)),
}


@dataclass
class Row:
    projection: str
    layout: str
    tuning: str
    lora_us: float
    floor_us: float
    base_gemm_us: float


def make_batch(num_adapters: int, per_adapter: int, layout: str, rank: int) -> LoraBatchInfo:
    """Decode batch: one token per request; `interleaved` alternates adapters, `grouped` sorts them."""
    slots = [1 + i % num_adapters for i in range(num_adapters * per_adapter)]
    if layout == "grouped":
        slots.sort()
    ranks = [0] + [rank] * num_adapters
    scalings = [0.0] + [2.0] * num_adapters
    return LoraBatchInfo.from_segments([1] * len(slots), slots, ranks, scalings, DEVICE)


class Projection:
    """Weights, inputs and the LoRA call of one projection."""

    def __init__(self, name: str, num_tokens: int, num_slots: int, rank: int) -> None:
        k, widths = PROJECTIONS[name]
        self.name, self.num_slices, self.n = name, len(widths), sum(widths)
        self.offsets = [0]
        for width in widths:
            self.offsets.append(self.offsets[-1] + width)
        dt = dict(device=DEVICE, dtype=DTYPE)
        self.x = torch.randn(num_tokens, k, **dt)
        self.a = torch.randn(num_slots, self.num_slices * rank, k, **dt) / k**0.5
        self.b = torch.randn(num_slots, self.n, rank, **dt) / rank**0.5
        self.w = torch.randn(self.n, k, **dt) / k**0.5  # the base weight
        self.out = torch.empty(num_tokens, self.n, **dt)

    def lora(self, backend) -> torch.Tensor:
        y = backend.lora_a(self.x, self.a, self.num_slices)
        if self.name == "qkv":
            return backend.qkv_lora_b(y, self.b, self.offsets, self.out)
        if self.name == "gate_up":
            return backend.gate_up_lora_b(y, self.b, self.out)
        return backend.lora_b(y, self.b, self.out)

    def base(self) -> torch.Tensor:
        return torch.matmul(self.x, self.w.T, out=self.out)

    def floor_us(self, num_adapters: int) -> float:
        """Reading A and B of the adapters in the batch once, at the measured peak bandwidth."""
        weight_bytes = (self.a[0].numel() + self.b[0].numel()) * self.a.element_size() * num_adapters
        return weight_bytes / peak_bytes_per_s() * 1e6


def check_against_reference(proj: Projection, backend, info: LoraBatchInfo, ctx) -> None:
    native = TorchNativeLoraBackend(ctx)
    native.prepare_batch(info)
    base = torch.randn_like(proj.out)
    proj.out.copy_(base)
    expected = proj.lora(native).clone()
    proj.out.copy_(base)
    actual = proj.lora(backend)
    torch.testing.assert_close(actual.float(), expected.float(), atol=5e-2, rtol=2e-2)


def tunings():
    from backplane.plugins.lora_triton.backend import Tuning

    yield "auto", Tuning()
    for split_k in (1, 4, 8, 16):
        yield f"split_k={split_k}", Tuning(shrink_split_k=split_k)
    for block_n in (32, 128, 256):
        yield f"expand_block_n={block_n}", Tuning(expand_block_n=block_n)


def run(args) -> dict:
    from backplane.plugins.lora_triton.backend import TritonLoraBackend

    num_tokens, num_slots = args.adapters * args.per_adapter, args.adapters + 1
    ctx = LoraBackendContext(
        device=torch.device(DEVICE), dtype=DTYPE, max_loras_per_batch=args.adapters,
        max_lora_rank=args.rank, max_bs=num_tokens, max_num_tokens=max(num_tokens, 256),
    )  # fmt: skip
    projections = {name: Projection(name, num_tokens, num_slots, args.rank) for name in PROJECTIONS}
    base_us = {name: time_graph(p.base) for name, p in projections.items()}
    rows: list[Row] = []
    layer_us = {"base": time_graph(lambda: [p.base() for p in projections.values()])}
    for layout in ("interleaved", "grouped"):
        info = make_batch(args.adapters, args.per_adapter, layout, args.rank)
        backend = TritonLoraBackend(ctx)
        backend.prepare_batch(info)
        layer_us[f"base+lora {layout}"] = time_graph(
            lambda b=backend: [(p.base(), p.lora(b)) for p in projections.values()]
        )
        for tuning_name, tuning in tunings():
            backend = TritonLoraBackend(ctx, tuning)
            backend.prepare_batch(info)
            for name, proj in projections.items():
                check_against_reference(proj, backend, info, ctx)
                lora_us = time_graph(lambda p=proj, b=backend: p.lora(b))
                rows.append(Row(name, layout, tuning_name, lora_us, proj.floor_us(args.adapters), base_us[name]))
    return {**summarize(rows), "layer_us": layer_us}


def summarize(rows: list[Row]) -> dict:
    """Per layout and tuning: the per-layer LoRA total and its ratio to the base GEMMs."""
    layers = {}
    for row in rows:
        empty = {"lora_us": 0.0, "floor_us": 0.0, "base_gemm_us": 0.0}
        entry = layers.setdefault((row.layout, row.tuning), empty)
        entry["lora_us"] += row.lora_us
        entry["floor_us"] += row.floor_us
        entry["base_gemm_us"] += row.base_gemm_us
    per_layer = [
        {"layout": layout, "tuning": tuning, **entry, "lora_all_layers_ms": entry["lora_us"] * NUM_LAYERS / 1000}
        for (layout, tuning), entry in layers.items()
    ]
    return {"rows": [asdict(row) for row in rows], "per_layer": per_layer}


def print_table(result: dict) -> None:
    print(f"{'projection':<10} {'layout':<12} {'tuning':<18} {'lora us':>8} {'floor us':>9} {'base us':>8}")
    for row in result["rows"]:
        print(
            f"{row['projection']:<10} {row['layout']:<12} {row['tuning']:<18} {row['lora_us']:8.2f} "
            f"{row['floor_us']:9.2f} {row['base_gemm_us']:8.2f}"
        )
    print(f"\nper layer ({NUM_LAYERS} layers):")
    print(
        f"{'layout':<12} {'tuning':<18} {'lora us':>8} {'floor us':>9} {'base us':>8} {'lora/base':>9} "
        f"{'16 layers ms':>12}"
    )
    for entry in result["per_layer"]:
        print(
            f"{entry['layout']:<12} {entry['tuning']:<18} {entry['lora_us']:8.2f} {entry['floor_us']:9.2f} "
            f"{entry['base_gemm_us']:8.2f} {entry['lora_us'] / entry['base_gemm_us']:9.2f} "
            f"{entry['lora_all_layers_ms']:12.3f}"
        )
    print("\none layer's four projections in one graph (auto tuning):")
    base = result["layer_us"]["base"]
    for name, us in result["layer_us"].items():
        print(f"  {name:<24} {us:8.2f} us  x{us / base:.3f} of the base GEMMs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=8, help="distinct adapters in the batch")
    parser.add_argument("--per-adapter", type=int, default=4, help="decode requests per adapter")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (= R_max)")
    parser.add_argument("--out", default="lora_kernels.json", help="where to write the JSON results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/lora_kernels.py needs a CUDA GPU")
    torch.manual_seed(0)
    result = {"args": vars(args), "device": torch.cuda.get_device_name(), **run(args)}
    print_table(result)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
