"""Attention kernels side by side on one GPU: the triton backend's kernels against FlashInfer.

GQA 32 query / 8 KV heads, head dim 128, bfloat16, a page-size-1 KV pool in random slot order.
Decode: (batch, context) = (1, 4096), (16, 4096), (64, 4096), (256, 1024) against
BatchDecodeWithPagedKVCacheWrapper with and without tensor cores. Extend: 4 x 2048 and 1 x 8192
new tokens (causal, no prefix) against BatchPrefillWithRaggedKVCacheWrapper, and 8 x (2048 cached +
256 new) against BatchPrefillWithPagedKVCacheWrapper.

    python bench/attention.py --out results.json [--sweep]

Times are medians of CUDA-event timings of single calls with the L2 cache flushed before each.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from backplane.plugins.attention_triton.configs import (
    DecodeConfig,
    ExtendConfig,
    choose_num_kv_splits,
    decode_config,
    extend_config,
)
from backplane.plugins.attention_triton.decode_kernels import decode_attention
from backplane.plugins.attention_triton.extend_kernels import extend_attention

HEADS, KV_HEADS, HEAD_DIM, DTYPE = 32, 8, 128, torch.bfloat16
sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import peak_bytes_per_s  # noqa: E402  (bench/timing.py: the card's measured copy bandwidth)
DECODE_CASES = [(1, 4096), (16, 4096), (64, 4096), (256, 1024)]
EXTEND_CASES = [(4, 0, 2048), (1, 0, 8192), (8, 2048, 256)]  # (batch, cached prefix, new tokens)


# -- timing --------------------------------------------------------------------------------------


class Timer:
    """Median GPU time of single calls, each after an L2 flush (a 256 MB write).

    Each call is captured once in a CUDA graph and the graph is replayed, so the figures are kernel
    time as the engine sees it under graphs, not Python launch overhead (an eager fallback is used
    when a call cannot be captured; the row's note says so).
    """

    def __init__(self, warmup: int = 10, reps: int = 100):
        self.warmup, self.reps = warmup, reps
        self.flush = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
        self.last_mode = "graph"

    def _as_graph(self, fn):
        try:
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            torch.cuda.synchronize()
            self.last_mode = "graph"
            return graph.replay
        except Exception:  # noqa: BLE001 - some library calls cannot be captured; time them eagerly
            torch.cuda.synchronize()
            self.last_mode = "eager"
            return fn

    def median_us(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        call = self._as_graph(fn)
        for _ in range(3):
            call()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        for start, end in zip(starts, ends):
            self.flush.zero_()
            start.record()
            call()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1000.0


# -- workloads -----------------------------------------------------------------------------------


@dataclass
class Workload:
    """Requests whose keys live in a shuffled pool; the last `new_len` tokens of each are new."""

    batch: int
    prefix_len: int
    new_len: int
    k_buffer: torch.Tensor  # [num_slots + 1, KV_HEADS, HEAD_DIM]
    v_buffer: torch.Tensor
    req_to_token: torch.Tensor  # [batch, seq_len] int32
    q: torch.Tensor  # [batch * new_len, HEADS, HEAD_DIM]

    @property
    def seq_len(self) -> int:
        return self.prefix_len + self.new_len

    def new_kv(self):
        """The new tokens' k/v as contiguous [batch * new_len, KV_HEADS, HEAD_DIM] tensors."""
        slots = self.req_to_token[:, self.prefix_len :].reshape(-1).long()
        return self.k_buffer[slots].contiguous(), self.v_buffer[slots].contiguous()

    def kv_bytes(self) -> int:
        return 2 * self.batch * self.seq_len * KV_HEADS * HEAD_DIM * self.k_buffer.element_size()

    def causal_flops(self) -> float:
        visible = sum(self.prefix_len + i + 1 for i in range(self.new_len)) * self.batch
        return 4.0 * visible * HEAD_DIM * HEADS


def make_workload(batch: int, prefix_len: int, new_len: int, seed: int = 0) -> Workload:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = batch * (prefix_len + new_len)
    shape = (total + 1, KV_HEADS, HEAD_DIM)
    k_buffer = torch.randn(shape, generator=gen, device="cuda", dtype=DTYPE)
    v_buffer = torch.randn(shape, generator=gen, device="cuda", dtype=DTYPE)
    slots = torch.randperm(total, generator=gen, device="cuda").int() + 1
    q = torch.randn((batch * new_len, HEADS, HEAD_DIM), generator=gen, device="cuda", dtype=DTYPE)
    return Workload(batch, prefix_len, new_len, k_buffer, v_buffer, slots.view(batch, -1), q)


def indptr(counts: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int32, device="cuda")


# -- triton --------------------------------------------------------------------------------------


def triton_decode(w: Workload, splits: int, cfg: DecodeConfig | None = None):
    rows = torch.arange(w.batch, device="cuda")
    seq_lens = torch.full((w.batch,), w.seq_len, dtype=torch.int32, device="cuda")
    out = torch.empty_like(w.q)
    logits = torch.empty((w.batch, HEADS, splits, HEAD_DIM), dtype=torch.float32, device="cuda")
    lse = torch.empty((w.batch, HEADS, splits), dtype=torch.float32, device="cuda")
    scale = HEAD_DIM**-0.5
    # as the engine launches it: with counters, so that few splits merge inside the first kernel
    counters = torch.zeros(w.batch * KV_HEADS, dtype=torch.int32, device="cuda")
    return lambda: decode_attention(w.q, w.k_buffer, w.v_buffer, out, w.req_to_token, rows, seq_lens, scale,
                                    splits, attn_logits=logits, attn_lse=lse, config=cfg, merge_counters=counters)


def triton_extend(w: Workload, cfg: ExtendConfig | None = None):
    k_new, v_new = w.new_kv()
    rows = torch.arange(w.batch, device="cuda")
    qo_indptr = indptr([w.new_len] * w.batch)
    prefix = torch.full((w.batch,), w.prefix_len, dtype=torch.int32, device="cuda")
    out = torch.empty_like(w.q)
    return lambda: extend_attention(w.q, k_new, v_new, out, w.k_buffer, w.v_buffer, w.req_to_token, rows,
                                    qo_indptr, prefix, w.new_len, HEAD_DIM**-0.5, config=cfg)


# -- flashinfer ----------------------------------------------------------------------------------


def paged_kv(w: Workload):
    """FlashInfer's page-size-1 view: indptr, indices, last_page_len, (k_cache, v_cache) [pages, 1, Hkv, D]."""
    caches = (w.k_buffer.unsqueeze(1), w.v_buffer.unsqueeze(1))
    last = torch.ones(w.batch, dtype=torch.int32, device="cuda")
    return indptr([w.seq_len] * w.batch), w.req_to_token.reshape(-1), last, caches


def flashinfer_decode(fi, w: Workload, workspace: torch.Tensor, tensor_cores: bool):
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tensor_cores)
    kv_indptr, kv_indices, last, caches = paged_kv(w)
    wrapper.plan(kv_indptr, kv_indices, last, HEADS, KV_HEADS, HEAD_DIM, 1, q_data_type=DTYPE,
                 kv_data_type=DTYPE)
    return lambda: wrapper.run(w.q, caches)


def flashinfer_extend(fi, w: Workload, workspace: torch.Tensor):
    qo_indptr = indptr([w.new_len] * w.batch)
    if w.prefix_len == 0:
        wrapper = fi.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
        wrapper.plan(qo_indptr, qo_indptr, HEADS, KV_HEADS, HEAD_DIM, causal=True, q_data_type=DTYPE,
                     kv_data_type=DTYPE)
        k_new, v_new = w.new_kv()
        return lambda: wrapper.run(w.q, k_new, v_new)
    wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    kv_indptr, kv_indices, last, caches = paged_kv(w)
    wrapper.plan(qo_indptr, kv_indptr, kv_indices, last, HEADS, KV_HEADS, HEAD_DIM, 1, causal=True,
                 q_data_type=DTYPE, kv_data_type=DTYPE)
    return lambda: wrapper.run(w.q, caches)


# -- measuring -----------------------------------------------------------------------------------


@dataclass
class Row:
    kind: str  # decode | extend
    case: str
    impl: str
    us: float
    tb_per_s: float  # K and V bytes read / time
    tflop_per_s: float
    max_abs_diff: float | None = None  # against the first triton output of the case
    note: str = ""
    vs_flashinfer_best: float | None = None  # flashinfer's best time / this time (> 1: faster)
    roofline: float = field(init=False)

    def __post_init__(self):
        self.roofline = self.tb_per_s / (peak_bytes_per_s() / 1e12)


def measure(timer: Timer, w: Workload, kind: str, case: str, impl: str, fn, reference, note="") -> Row:
    out = fn()
    diff = None if reference is None else float((out.float() - reference.float()).abs().max())
    us = timer.median_us(fn)
    note = f"{note} [{timer.last_mode}]".strip()
    return Row(kind, case, impl, us, w.kv_bytes() / us / 1e6, w.causal_flops() / us / 1e6, diff, note)


def decode_sweep(timer: Timer, w: Workload, case: str, auto_splits: int, reference) -> Row | None:
    best = None
    for splits in sorted({max(1, auto_splits // 2), auto_splits, auto_splits * 2, auto_splits * 4}):
        for block_n, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4)):
            cfg = DecodeConfig(block_n=block_n, num_warps=warps, num_stages=stages)
            note = f"splits={splits} block_n={block_n} warps={warps} stages={stages}"
            try:
                row = measure(timer, w, "decode", case, "triton-sweep-best", triton_decode(w, splits, cfg),
                              reference, note)
            except Exception as exc:  # a config the GPU cannot run (shared memory, registers)
                print(f"  skip {note}: {type(exc).__name__}")
                continue
            best = row if best is None or row.us < best.us else best
    return best


def extend_sweep(timer: Timer, w: Workload, case: str, reference) -> Row | None:
    best = None
    for block_m, block_n, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)):
        if block_m % block_n:
            continue
        cfg = ExtendConfig(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages)
        note = f"block_m={block_m} block_n={block_n} warps={warps} stages={stages}"
        try:
            row = measure(timer, w, "extend", case, "triton-sweep-best", triton_extend(w, cfg), reference, note)
        except Exception as exc:
            print(f"  skip {note}: {type(exc).__name__}")
            continue
        best = row if best is None or row.us < best.us else best
    return best


def bench_decode(timer, fi, workspace, sweep: bool) -> list[Row]:
    rows = []
    for batch, ctx in DECODE_CASES:
        w = make_workload(batch, ctx - 1, 1)
        case = f"bs={batch} ctx={ctx}"
        splits = choose_num_kv_splits(batch, KV_HEADS, ctx, torch.device("cuda"), 64)
        cfg = decode_config(HEAD_DIM, torch.device("cuda"))
        fn = triton_decode(w, splits)
        reference = fn().clone()
        case_rows = [measure(timer, w, "decode", case, "triton", fn, None,
                             f"splits={splits} block_n={cfg.block_n} warps={cfg.num_warps} stages={cfg.num_stages}")]
        if sweep:
            case_rows.append(decode_sweep(timer, w, case, splits, reference))
        for tensor_cores in (False, True) if fi else ():
            impl = "flashinfer-decode" + ("-tc" if tensor_cores else "")
            case_rows.append(measure(timer, w, "decode", case, impl,
                                     flashinfer_decode(fi, w, workspace, tensor_cores), reference))
        rows += compare_to_flashinfer([r for r in case_rows if r is not None])
        del w
    return rows


def bench_extend(timer, fi, workspace, sweep: bool) -> list[Row]:
    rows = []
    for batch, prefix, new in EXTEND_CASES:
        w = make_workload(batch, prefix, new)
        case = f"{batch}x({prefix}+{new})"
        cfg = extend_config(HEAD_DIM, DTYPE, torch.device("cuda"))
        fn = triton_extend(w)
        reference = fn().clone()
        case_rows = [measure(timer, w, "extend", case, "triton", fn, None,
                             f"block_m={cfg.block_m} block_n={cfg.block_n} warps={cfg.num_warps} "
                             f"stages={cfg.num_stages}")]
        if sweep:
            case_rows.append(extend_sweep(timer, w, case, reference))
        if fi:
            impl = "flashinfer-prefill-" + ("ragged" if prefix == 0 else "paged")
            case_rows.append(measure(timer, w, "extend", case, impl, flashinfer_extend(fi, w, workspace),
                                     reference))
        rows += compare_to_flashinfer([r for r in case_rows if r is not None])
        del w
    return rows


def compare_to_flashinfer(rows: list[Row]) -> list[Row]:
    fi_times = [r.us for r in rows if r.impl.startswith("flashinfer")]
    for row in rows:
        row.vs_flashinfer_best = min(fi_times) / row.us if fi_times else None
    return rows


# -- report --------------------------------------------------------------------------------------


def print_table(rows: list[Row]) -> None:
    head = f"{'kind':7} {'case':18} {'impl':24} {'us':>9} {'TB/s':>6} {'TFLOP/s':>8} {'vs FI':>6} " \
           f"{'roof':>5} {'max|d|':>7}  note"
    print(head)
    print("-" * len(head))
    for r in rows:
        vs = f"{r.vs_flashinfer_best:6.2f}" if r.vs_flashinfer_best is not None else "     -"
        diff = f"{r.max_abs_diff:7.4f}" if r.max_abs_diff is not None else "      -"
        print(f"{r.kind:7} {r.case:18} {r.impl:24} {r.us:9.1f} {r.tb_per_s:6.2f} {r.tflop_per_s:8.1f} {vs} "
              f"{r.roofline:5.0%} {diff}  {r.note}")


def import_flashinfer():
    try:
        import flashinfer
    except ImportError:
        print("flashinfer: not installed")
        return None
    print(f"flashinfer: {getattr(flashinfer, '__version__', '?')}")
    return flashinfer


def main() -> None:
    global HEAD_DIM, DECODE_CASES
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--sweep", action="store_true", help="also try block sizes / warps / stages / splits")
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--only", choices=("decode", "extend"), help="run one half")
    parser.add_argument("--head-dim", type=int, default=HEAD_DIM,
                        help="head dim of every case (128: llama-3.1-8b; 64: llama-3.2-1b, whose decode config is "
                             "the 128 one untuned)")
    parser.add_argument("--decode-cases", help="BATCHxCONTEXT,... instead of the default decode cases, "
                                               "e.g. 1x512,8x512,32x512 (bench/peer_decode.py's shapes)")
    args = parser.parse_args()
    HEAD_DIM = args.head_dim
    if args.decode_cases:
        DECODE_CASES = [tuple(int(n) for n in case.split("x")) for case in args.decode_cases.split(",")]
    if not torch.cuda.is_available():
        raise SystemExit("bench/attention.py needs a CUDA GPU")
    import triton

    fi = import_flashinfer()
    timer = Timer(reps=args.reps)
    workspace = torch.zeros(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    rows = []
    if args.only != "extend":
        rows += bench_decode(timer, fi, workspace, args.sweep)
    if args.only != "decode":
        rows += bench_extend(timer, fi, workspace, args.sweep)
    print(f"device: {torch.cuda.get_device_name()}  peak for roofline: {peak_bytes_per_s() / 1e12:.2f} TB/s (measured copy)")
    print_table(rows)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "flashinfer": getattr(fi, "__version__", None) if fi else None, "peak_tb_per_s": peak_bytes_per_s() / 1e12,
            "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": str(DTYPE)}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
