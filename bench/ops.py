"""Benchmark of the ops_triton custom ops against the native ops (GPU only).

Llama-3.1-8B shapes (hidden 4096, intermediate 14336, 32 q heads / 8 kv heads of 128), bf16, for
several token counts. Each op is timed inside a CUDA graph (median over replays of a graph holding
20 calls, CUDA events: kernel time without launch overhead) as triton, native (eager torch ops) and
native under torch.compile (Inductor's fused kernels), plus one eager call of triton and native
(with launch overhead, what an eager decode step pays). `GB/s` is the bytes an op must move over
the triton time, against the card's measured copy bandwidth.

    python bench/ops.py --out ops.json
"""

from __future__ import annotations

import argparse
import sys
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from backplane.ops import native
from backplane.ops.rope import build_cos_sin_cache
from backplane.plugins.ops_triton import ops

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import peak_bytes_per_s, time_graph  # noqa: E402  (bench/timing.py)

HIDDEN, INTER, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128
NUM_SLOTS = 65536
DTYPE = torch.bfloat16
TOKENS = (1, 8, 32, 128, 1024, 4096)


@dataclass
class Row:
    op: str
    tokens: int
    triton_us: float
    native_us: float
    compiled_us: float
    triton_eager_us: float
    native_eager_us: float
    gbps: float


def time_eager(fn: Callable[[], object], calls: int = 200) -> float:
    """Microseconds per call of back-to-back eager calls (host launch cost included)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e6 / calls


def cases(tokens: int) -> dict[str, tuple[str, tuple, int]]:
    """op name -> (table key, arguments, bytes the op must read and write)."""
    def rand(*shape):
        return torch.randn(*shape, device="cuda").to(DTYPE)

    x, residual, w, gate_up = rand(tokens, HIDDEN), rand(tokens, HIDDEN), rand(HIDDEN), rand(tokens, 2 * INTER)
    q, k, v = rand(tokens, NUM_HEADS, HEAD_DIM), rand(tokens, NUM_KV_HEADS, HEAD_DIM), rand(tokens, NUM_KV_HEADS, HEAD_DIM)
    positions = torch.randint(0, 8192, (tokens,), device="cuda")
    cos_sin = build_cos_sin_cache(HEAD_DIM, 8192, 500000.0).cuda()
    k_cache, v_cache = rand(NUM_SLOTS, NUM_KV_HEADS, HEAD_DIM), rand(NUM_SLOTS, NUM_KV_HEADS, HEAD_DIM)
    loc = torch.randperm(NUM_SLOTS - 1, device="cuda")[:tokens] + 1
    size = 2  # bytes per bf16 element
    qk = (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM
    return {
        "rms_norm": ("rms_norm", (x, w, 1e-6), 2 * tokens * HIDDEN * size),
        "fused_add_rms_norm": ("fused_add_rms_norm", (x, residual, w, 1e-6), 4 * tokens * HIDDEN * size),
        "silu_and_mul": ("silu_and_mul", (gate_up,), 3 * tokens * INTER * size),
        "rotary_embedding": ("rotary_embedding", (positions, q, k, cos_sin, True), 2 * tokens * qk * size),
        "rotary_kv_write": ("rotary_kv_write", (positions, q, k, v, cos_sin, True, k_cache, v_cache, loc),
                            (2 * qk + 3 * NUM_KV_HEADS * HEAD_DIM) * tokens * size),
    }


def bench_op(name: str, tokens: int, key: str, args: tuple, num_bytes: int) -> Row:
    triton_fn, native_fn = ops.TRITON_OPS[key], native.NATIVE_OPS[key]
    compiled_fn = torch.compile(native_fn, dynamic=False)
    triton_us = time_graph(lambda: triton_fn(*args))
    return Row(
        op=name, tokens=tokens, triton_us=triton_us,
        native_us=time_graph(lambda: native_fn(*args)),
        compiled_us=time_graph(lambda: compiled_fn(*args)),
        triton_eager_us=time_eager(lambda: triton_fn(*args)),
        native_eager_us=time_eager(lambda: native_fn(*args)),
        gbps=num_bytes / (triton_us * 1e-6) / 1e9,
    )


def bench(tokens: int) -> list[Row]:
    return [bench_op(name, tokens, *case) for name, case in cases(tokens).items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    args = parser.parse_args()
    torch._dynamo.config.cache_size_limit = 256
    rows = [row for tokens in args.tokens for row in bench(tokens)]
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "dtype": str(DTYPE),
                       "peak_bytes_per_s": peak_bytes_per_s(), "rows": [asdict(r) for r in rows]}, f, indent=1)
    print(f"{'op':<20}{'tokens':>7}{'triton':>9}{'native':>9}{'compiled':>10}{'x native':>9}{'x compiled':>11}"
          f"{'eager tr':>10}{'eager nat':>10}{'GB/s':>8}")
    for r in rows:
        print(f"{r.op:<20}{r.tokens:>7}{r.triton_us:>9.2f}{r.native_us:>9.2f}{r.compiled_us:>10.2f}"
              f"{r.native_us / r.triton_us:>9.2f}{r.compiled_us / r.triton_us:>11.2f}"
              f"{r.triton_eager_us:>10.1f}{r.native_eager_us:>10.1f}{r.gbps:>8.0f}")


if __name__ == "__main__":
    main()
