"""The ops_triton custom ops against the native ops and the native ops under torch.compile (GPU).

Llama-3.1-8B shapes (hidden 4096, intermediate 14336, 32 query / 8 KV heads of 128), bf16, at
several token counts. Kernel columns: each op timed inside a CUDA graph (bench/timing.time_graph: no
launch cost), as triton, native (eager torch ops) and native compiled (Inductor's fused kernels);
eager columns: back-to-back eager calls timed on the host, launch included, what an eager forward
pays per op. GB/s: the bytes the op must move over the triton time.

    python -m bench.ops --tokens 1 8 32 128 1024 4096
"""

from __future__ import annotations

import argparse
from typing import Callable

import torch

from bench import report
from bench.timing import time_graph, timed

HIDDEN, INTER, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_SLOTS = 4096, 14336, 32, 8, 128, 65536
COLUMNS = [("op", "op", ""), ("tokens", "tokens", "d"), ("triton", "triton_us", ".2f"), ("native", "native_us", ".2f"),
           ("compiled", "compiled_us", ".2f"), ("x native", "x_native", ".2f"), ("x compiled", "x_compiled", ".2f"),
           ("eager triton", "triton_eager_us", ".1f"), ("eager native", "native_eager_us", ".1f"), ("GB/s", "gbps", ".0f")]


def eager_us(fn: Callable[[], object], calls: int = 200) -> float:
    """Microseconds per call of back-to-back eager calls (the host's launch cost included), after 3 warm-up calls."""
    for _ in range(3):
        fn()
    return timed(lambda: [fn() for _ in range(calls)], "cuda")[0] * 1e6 / calls


def cases(tokens: int) -> dict[str, tuple[tuple, int]]:
    """op name -> (arguments, bytes the op must read and write)."""
    from backplane.ops.rope import build_cos_sin_cache

    def rand(*shape):
        return torch.randn(*shape, device="cuda").to(torch.bfloat16)

    x, residual, w, gate_up = rand(tokens, HIDDEN), rand(tokens, HIDDEN), rand(HIDDEN), rand(tokens, 2 * INTER)
    q, k, v = rand(tokens, NUM_HEADS, HEAD_DIM), rand(tokens, NUM_KV_HEADS, HEAD_DIM), rand(tokens, NUM_KV_HEADS, HEAD_DIM)
    positions = torch.randint(0, 8192, (tokens,), device="cuda")
    cos_sin = build_cos_sin_cache(HEAD_DIM, 8192, 500000.0).cuda()
    k_cache, v_cache = rand(NUM_SLOTS, NUM_KV_HEADS, HEAD_DIM), rand(NUM_SLOTS, NUM_KV_HEADS, HEAD_DIM)
    loc = torch.randperm(NUM_SLOTS - 1, device="cuda")[:tokens] + 1
    qk = (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM
    return {"rms_norm": ((x, w, 1e-6), 2 * tokens * HIDDEN * 2),
            "fused_add_rms_norm": ((x, residual, w, 1e-6), 4 * tokens * HIDDEN * 2),
            "silu_and_mul": ((gate_up,), 3 * tokens * INTER * 2),
            "rotary_embedding": ((positions, q, k, cos_sin, True), 2 * tokens * qk * 2),
            "rotary_kv_write": ((positions, q, k, v, cos_sin, True, k_cache, v_cache, loc),
                                (2 * qk + 3 * NUM_KV_HEADS * HEAD_DIM) * tokens * 2)}


def bench_op(name: str, tokens: int, args: tuple, num_bytes: int) -> dict:
    from backplane.ops import native
    from backplane.plugins.ops_triton import ops

    triton_fn, native_fn = ops.TRITON_OPS[name], native.NATIVE_OPS[name]
    compiled_fn = torch.compile(native_fn, dynamic=False)
    row = {"op": name, "tokens": tokens, "triton_us": time_graph(lambda: triton_fn(*args)),
           "native_us": time_graph(lambda: native_fn(*args)), "compiled_us": time_graph(lambda: compiled_fn(*args)),
           "triton_eager_us": eager_us(lambda: triton_fn(*args)), "native_eager_us": eager_us(lambda: native_fn(*args))}
    row["gbps"] = num_bytes / (row["triton_us"] * 1e-6) / 1e9
    return report.add_ratios([row], {"x_native": ("native_us", "triton_us"), "x_compiled": ("compiled_us", "triton_us")})[0]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = report.parser(__doc__, device=False)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128, 1024, 4096])
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    ns = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.ops needs a CUDA GPU")
    torch._dynamo.config.cache_size_limit = 256
    rows = [bench_op(name, t, *case) for t in ns.tokens for name, case in cases(t).items()]
    report.write_result("ops", "llama-3.1-8b-shapes", {"args": vars(ns), "rows": rows}, ns.out)
    print(report.table(rows, COLUMNS))
    return rows


if __name__ == "__main__":
    main()
