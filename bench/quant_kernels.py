"""The FP8 GEMMs of one layer against their weight-read floor: quant_fp8's Triton kernel (per-channel
weight scales, per-token activation scales applied in the epilogue, x quantized inside it or just
before it), torch._scaled_mm row-wise with torch's per-token quantization (the path quant_fp8 took
at every size before the kernel) and with quant_fp8's quantization kernel (its path above the decode
threshold), torch._scaled_mm tensor-wise with the scale kernel after it (`tensorwise`), the bf16 matmul, and the block-wise kernel (128 x 128 weight blocks), at each token count.

Times are medians of L2-cold calls (bench/timing.time_cold: CUDA-graph replays, L2 flushed before
each, so the weight comes from HBM as in a model step), every activation quantization included. The
floor is the FP8 weight's bytes at the card's copy bandwidth. Every output is checked against the
dequantized fp32 reference first: a fast wrong kernel is no result. "cuda_linear" says what the
plugin runs at that size (the card's launch table, else the defaults and the threshold).

On CPU (TRITON_INTERPRET=1, float32, a small preset) the code path only; torch._scaled_mm is skipped.

    python -m bench.quant_kernels --model llama-3.1-8b --tokens 1 8 32 128 512
    python -m bench.quant_kernels --tokens 1 8 --configs t.json   # a table tune.py just wrote
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from bench import report
from bench.timing import copy_tb_s, time_us
from bench.workload import projection_shapes

BLOCK = (128, 128)
VARIANTS = ("triton", "scaled_mm", "scaled_mm_qk", "tensorwise", "bf16", "block")
TARGET_VS_FLOOR = 1.25  # decode sizes: the kernel within this of reading its weight once
LINEARS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
           "down": ("down_proj",)}
COLUMNS = [("linear", "linear", ""), ("M", "tokens", "d"), ("triton", "triton_us", ".1f"),
           ("_scaled_mm", "scaled_mm_us", ".1f"), ("+qkernel", "scaled_mm_qk_us", ".1f"),
           ("tensorwise", "tensorwise_us", ".1f"), ("bf16", "bf16_us", ".1f"),
           ("block", "block_us", ".1f"), ("floor", "floor_us", ".1f"), ("triton/floor", "triton_vs_floor", ".2f"),
           ("/_scaled_mm", "triton_vs_scaled_mm", ".2f"), ("/bf16", "triton_vs_bf16", ".2f"),
           ("cuda_linear", "use", ""), ("verdict", "verdict", ""), ("launch", "launch", "")]


class Linear:
    """One linear's weight [N, K] as bf16, FP8 with per-channel scales and FP8 with block scales; x [M, K]."""

    def __init__(self, n: int, k: int, m: int, device: torch.device, dtype: torch.dtype, source=None):
        from backplane.plugins.quant_fp8 import quantize as fq
        from backplane.plugins.quant_fp8.kernels import new_counters

        w = torch.randn(n, k, device=device) / k**0.5
        self.key, self.m = ("channel", n, k, None), m
        self.w = w.to(dtype)
        self.q, self.s = fq.quantize_weight_per_channel(w)
        self.qb, self.sb = fq.quantize_weight_blocks(w, *BLOCK)
        self.x = torch.randn(m, k, device=device).to(dtype)
        self.counters = new_counters(self.q)
        self.source = source  # cuda.TableSource of --configs; None: the card's bundled table

    def launches(self):
        """(what cuda_linear runs, the channel launch, the block launch) at this size."""
        from backplane.plugins.quant_fp8 import cuda

        block_key = ("block", *self.key[1:3], BLOCK)
        if self.x.is_cuda:
            source = self.source or cuda.BUNDLED
            use, launch = cuda.choose(self.key, self.m, self.x.dtype, self.x.device, source)
            return use, launch, cuda.choose(block_key, self.m, self.x.dtype, self.x.device, source)[1]
        size = self.x.element_size()
        return "triton", cuda.default_launch(self.key, self.m, size, 132), cuda.default_launch(block_key, self.m, size, 132)

    def variants(self, launch, block_launch) -> dict:
        from backplane.plugins.quant_fp8 import cuda, kernels
        from backplane.plugins.quant_fp8 import quantize as fq

        def scaled_mm():  # torch's per-token quantization, then row-wise _scaled_mm
            q, scale = fq.quantize_per_token(self.x)
            return torch._scaled_mm(q, self.q.t(), scale_a=scale, scale_b=self.s.reshape(1, -1), out_dtype=self.x.dtype)

        found = {"triton": lambda: kernels.channel_matmul(self.x, self.q, self.s, None, launch, self.counters),
                 "block": lambda: kernels.block_matmul(self.x, self.qb, self.sb, BLOCK, None, block_launch, self.counters),
                 "bf16": lambda: F.linear(self.x, self.w)}
        found["tensorwise"] = lambda: cuda.tensorwise(channel_scheme(), self.x, self.q, self.s, None, None)
        if self.x.is_cuda:
            found["scaled_mm"] = scaled_mm
            found["scaled_mm_qk"] = lambda: cuda._rowwise(channel_scheme(), self.x, self.q, self.s, None, None)
        return found

    def check(self, variants: dict) -> None:
        """Every FP8 variant against its dequantized fp32 reference (bf16 tolerances), bf16 against fp32."""
        from backplane.plugins.quant_fp8.reference import reference_linear
        from backplane.plugins.quant_fp8.scheme import Fp8Scheme

        block = Fp8Scheme(weights="block", activations="group", block=BLOCK)
        want = {"block": reference_linear(block, self.x.float(), self.qb, self.sb, None, None),
                "bf16": self.x.float() @ self.w.float().t()}
        channel = reference_linear(channel_scheme(), self.x.float(), self.q, self.s, None, None)
        for name, fn in variants.items():
            torch.testing.assert_close(fn().float(), want.get(name, channel), rtol=2e-2, atol=2e-2, msg=name)


def channel_scheme():
    from backplane.plugins.quant_fp8.scheme import Fp8Scheme

    return Fp8Scheme(weights="channel", activations="token")


def linear_shapes(model: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each fused linear of a model preset: qkv, o, gate_up, down."""
    from backplane.models.presets import get_preset

    shapes = projection_shapes(get_preset(model))
    return {name: (sum(shapes[p][1] for p in parts), shapes[parts[0]][0]) for name, parts in LINEARS.items()}


def linear_report(name: str, n: int, k: int, m: int, device: torch.device, dtype: torch.dtype, source=None) -> dict:
    """One linear at M tokens: µs of every variant, the floor and the ratios (launches from `source`'s table)."""
    lin = Linear(n, k, m, device, dtype, source)
    use, launch, block_launch = lin.launches()
    variants = lin.variants(launch, block_launch)
    lin.check(variants)
    row = {"linear": name, "tokens": m, "N": n, "K": k, "use": use, "launch": _short(launch),
           "block_launch": _short(block_launch),
           **{f"{v}_us": time_us(variants[v], device, cold=True) if v in variants else None for v in VARIANTS},
           "floor_us": n * k / copy_tb_s(device.type) / 1e6}
    del lin
    return row


def _short(launch) -> str:
    fused = "q" if launch.fuse_quant else ""
    gemv = "/gemv" if launch.gemv else ""
    return f"{launch.block_n}x{launch.block_k}/s{launch.split_k}/w{launch.num_warps}/p{launch.num_stages}{fused}{gemv}"


def with_totals(rows: list[dict], tokens: list[int]) -> list[dict]:
    """The rows, each token count followed by the layer's total; ratios and verdicts on every row."""
    out = []
    for m in tokens:
        group = [r for r in rows if r["tokens"] == m]
        total = {"linear": "layer", "tokens": m, "use": "", "launch": ""}
        for key in [f"{v}_us" for v in VARIANTS] + ["floor_us"]:
            total[key] = sum(r[key] for r in group) if all(r[key] is not None for r in group) else None
        out += group + [total]
    report.add_ratios(out, {"triton_vs_floor": ("triton_us", "floor_us"), "triton_vs_scaled_mm": ("triton_us", "scaled_mm_us"),
                            "triton_vs_bf16": ("triton_us", "bf16_us"), "block_vs_floor": ("block_us", "floor_us"),
                            "tensorwise_vs_floor": ("tensorwise_us", "floor_us")})
    for row in out:
        at_decode = row["tokens"] <= 64
        row["verdict"] = report.verdict(row["triton_vs_floor"], TARGET_VS_FLOOR) if at_decode else ""
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = report.parser(__doc__)
    p.add_argument("--model", default="llama-3.1-8b", help="a model preset (its linear shapes)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    p.add_argument("--configs", default=None, metavar="PATH",
                   help="the launch table cuda_linear reads (the engine's --fp8.configs); default: the card's bundled one")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    ns = parse_args(argv)
    device = torch.device(ns.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    source = None
    if ns.configs:
        from backplane.plugins.quant_fp8 import cuda

        source = cuda.table_source(ns.configs)  # a one-line error now for a file cuda.py would refuse
    rows = [linear_report(name, n, k, m, device, dtype, source)
            for m in ns.tokens for name, (n, k) in linear_shapes(ns.model).items()]
    rows = with_totals(rows, ns.tokens)
    subject = ns.model if not ns.configs else f"{ns.model}-configs-{Path(ns.configs).stem}"
    report.write_result("quant-kernels", subject, {"args": vars(ns), "copy_tb_s": copy_tb_s(device.type), "rows": rows},
                        ns.out, ns.device)
    print(report.table(rows, COLUMNS, f"{ns.model}: FP8 GEMMs, µs (L2-cold); verdict: triton <= {TARGET_VS_FLOOR}x "
                                      "the FP8 weight-read floor at M <= 64"))
    return rows


if __name__ == "__main__":
    main()
