"""The triton backend's attention kernels against FlashInfer's on the same data, one GPU.

GQA 32 query / 8 KV heads (head dim --head-dim), bf16, a page-size-1 KV pool in random slot order.
--kv-dtype fp8_e4m3: the pool holds the same random values in float8_e4m3fn (scale 1.0), read by
both libraries with k_scale = v_scale = 1.0; decode only (the extend cases are skipped).
Decode: the --decode-cases (batch x context) against BatchDecodeWithPagedKVCacheWrapper with and
without tensor cores. Extend (causal, --only extend): 4 x 2048 and 1 x 8192 new tokens against
BatchPrefillWithRaggedKVCacheWrapper, 8 x (2048 cached + 256 new) against the paged one. Each call is
captured in a CUDA graph and replayed after an L2 flush (bench/timing.time_cold): kernel times as
under the engine's graphs. "vs FI" is FlashInfer's best time over ours (above 1: faster); "roof"
the K/V bytes read per second over the card's copy bandwidth. --sweep adds the best of the launch settings.

    python -m bench.attention --sweep
    python -m bench.attention --only decode --head-dim 64 --decode-cases 1x512 8x512 32x512 32x2048
    python -m bench.attention --only decode --kv-dtype fp8_e4m3 --sweep --decode-cases 8x16384 1x16384
"""

from __future__ import annotations

import argparse
import itertools

import torch

from backplane.contracts.memory import FP8_E4M3, quantize_fp8
from bench import report
from bench.timing import copy_tb_s, time_cold

HEADS, KV_HEADS, DTYPE = 32, 8, torch.bfloat16
KV_DTYPES = {"bf16": DTYPE, "fp8_e4m3": FP8_E4M3}  # --kv-dtype: the pool's element type
KV_SCALE = 1.0  # an FP8 pool's k_scale and v_scale (stored value x scale = the value)
EXTEND_CASES = [(4, 0, 2048), (1, 0, 8192), (8, 2048, 256)]  # (batch, cached prefix, new tokens)
COLUMNS = [("kind", "kind", ""), ("case", "case", ""), ("impl", "impl", ""), ("us", "us", ".1f"), ("TB/s", "tb_s", ".2f"),
           ("TFLOP/s", "tflop_s", ".1f"), ("vs FI", "vs_flashinfer", ".2f"), ("roof", "roofline", ".0%"),
           ("max|d|", "max_abs_diff", ".4f"), ("note", "note", "")]


class Workload:
    """`batch` requests of `prefix_len` cached and `new_len` new tokens whose keys live in a shuffled
    page-size-1 pool: k_buffer, v_buffer [num_slots + 1, KV_HEADS, head_dim] (slot 0 unused),
    req_to_token [batch, seq_len] int32, q [batch * new_len, HEADS, head_dim]; random bf16, seeded.
    kv_dtype FP8_E4M3: the same K/V values quantized with scale KV_SCALE (saturated to +-448)."""

    def __init__(self, batch: int, prefix_len: int, new_len: int, head_dim: int, seed: int = 0,
                 kv_dtype: torch.dtype = DTYPE):
        self.batch, self.prefix_len, self.new_len, self.head_dim = batch, prefix_len, new_len, head_dim
        self.seq_len, total = prefix_len + new_len, batch * (prefix_len + new_len)
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.req_to_token = (torch.randperm(total, generator=gen, device="cuda").int() + 1).view(batch, -1)
        kv_shape, q_shape = (total + 1, KV_HEADS, head_dim), (batch * new_len, HEADS, head_dim)
        self.k_buffer, self.v_buffer, self.q = (torch.randn(shape, generator=gen, device="cuda", dtype=DTYPE)
                                                for shape in (kv_shape, kv_shape, q_shape))
        if kv_dtype == FP8_E4M3:
            self.k_buffer, self.v_buffer = (quantize_fp8(buf, KV_SCALE) for buf in (self.k_buffer, self.v_buffer))

    @property
    def kv_fp8(self) -> bool:
        return self.k_buffer.dtype == FP8_E4M3

    def new_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The new tokens' k/v as contiguous [batch * new_len, KV_HEADS, head_dim] tensors."""
        slots = self.req_to_token[:, self.prefix_len:].reshape(-1).long()
        return self.k_buffer[slots].contiguous(), self.v_buffer[slots].contiguous()

    def kv_bytes(self) -> int:
        """K and V bytes read: element_size() is 1 for an FP8 pool."""
        return 2 * self.batch * self.seq_len * KV_HEADS * self.head_dim * self.k_buffer.element_size()

    def causal_flops(self) -> float:
        return 4.0 * sum(self.prefix_len + i + 1 for i in range(self.new_len)) * self.batch * self.head_dim * HEADS


def indptr(counts: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int32, device="cuda")


def triton_decode(w: Workload, splits: int, cfg=None):
    from backplane.plugins.attention_triton.decode_kernels import decode_attention

    rows, out = torch.arange(w.batch, device="cuda"), torch.empty_like(w.q)
    seq_lens = torch.full((w.batch,), w.seq_len, dtype=torch.int32, device="cuda")
    logits = torch.empty((w.batch, HEADS, splits, w.head_dim), dtype=torch.float32, device="cuda")
    lse = torch.empty((w.batch, HEADS, splits), dtype=torch.float32, device="cuda")
    counters = torch.zeros(w.batch * KV_HEADS, dtype=torch.int32, device="cuda")  # as the engine launches it
    return lambda: decode_attention(w.q, w.k_buffer, w.v_buffer, out, w.req_to_token, rows, seq_lens, w.head_dim**-0.5,
                                    splits, attn_logits=logits, attn_lse=lse, config=cfg, merge_counters=counters,
                                    k_scale=KV_SCALE, v_scale=KV_SCALE)


def triton_extend(w: Workload, cfg=None):
    from backplane.plugins.attention_triton.extend_kernels import extend_attention

    k_new, v_new = w.new_kv()
    rows, out = torch.arange(w.batch, device="cuda"), torch.empty_like(w.q)
    prefix = torch.full((w.batch,), w.prefix_len, dtype=torch.int32, device="cuda")
    return lambda: extend_attention(w.q, k_new, v_new, out, w.k_buffer, w.v_buffer, w.req_to_token, rows,
                                    indptr([w.new_len] * w.batch), prefix, w.new_len, w.head_dim**-0.5, config=cfg)


def flashinfer_call(fi, w: Workload, workspace: torch.Tensor, kind: str):
    """FlashInfer's wrapper for `kind` ("decode", "decode-tc", "prefill"), planned for w; its run call.
    An FP8 pool: the decode wrappers are planned for float8_e4m3fn K/V and run with its scales."""
    caches = (w.k_buffer.unsqueeze(1), w.v_buffer.unsqueeze(1))  # page-size-1 view [pages, 1, Hkv, D]
    kv_indptr, kv_indices = indptr([w.seq_len] * w.batch), w.req_to_token.reshape(-1)
    last = torch.ones(w.batch, dtype=torch.int32, device="cuda")
    types = dict(q_data_type=DTYPE, kv_data_type=w.k_buffer.dtype)
    scales = dict(k_scale=KV_SCALE, v_scale=KV_SCALE) if w.kv_fp8 else {}
    if kind.startswith("decode"):
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=kind == "decode-tc")
        wrapper.plan(kv_indptr, kv_indices, last, HEADS, KV_HEADS, w.head_dim, 1, **types)
        return lambda: wrapper.run(w.q, caches, **scales)
    assert not w.kv_fp8, "the FP8 KV bench runs decode only"
    qo_indptr = indptr([w.new_len] * w.batch)
    if w.prefix_len == 0:
        wrapper = fi.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
        wrapper.plan(qo_indptr, qo_indptr, HEADS, KV_HEADS, w.head_dim, causal=True, **types)
        k_new, v_new = w.new_kv()
        return lambda: wrapper.run(w.q, k_new, v_new)
    wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(qo_indptr, kv_indptr, kv_indices, last, HEADS, KV_HEADS, w.head_dim, 1, causal=True, **types)
    return lambda: wrapper.run(w.q, caches)


def measure(w: Workload, kind: str, case: str, impl: str, fn, reference, note: str = "") -> dict:
    out = fn()
    us, mode = time_cold(fn)
    return {"kind": kind, "case": case, "impl": impl, "us": us, "tb_s": w.kv_bytes() / us / 1e6,
            "tflop_s": w.causal_flops() / us / 1e6, "roofline": w.kv_bytes() / us / 1e6 / copy_tb_s(),
            "max_abs_diff": None if reference is None else float((out.float() - reference.float()).abs().max()),
            "note": f"{note} [{mode}]".strip()}


DECODE_SWEEP = ((32, 64, 128), (2, 3, 4))  # decode --sweep: (keys a step, pipeline stages), x splits and warps
DECODE_SWEEP_FP8 = ((64, 128, 256), (2, 3, 4, 5))  # 1-byte K/V: more keys and stages fit the same shared memory


def sweep(w: Workload, kind: str, case: str, reference, auto_splits: int) -> dict | None:
    """The fastest launch setting of the triton kernel (a setting the GPU cannot run is skipped)."""
    from backplane.plugins.attention_triton.configs import DecodeConfig, ExtendConfig

    if kind == "decode":
        splits = sorted({max(1, auto_splits // 2), auto_splits, auto_splits * 2, auto_splits * 4})
        block_n, stages = DECODE_SWEEP_FP8 if w.kv_fp8 else DECODE_SWEEP
        settings = [(s, DecodeConfig(block_n=n, num_warps=wp, num_stages=st), f"splits={s} block_n={n} warps={wp} stages={st}")
                    for s, n, wp, st in itertools.product(splits, block_n, (2, 4, 8), stages)]
    else:
        settings = [(0, ExtendConfig(block_m=m, block_n=n, num_warps=wp, num_stages=st), f"block_m={m} block_n={n} "
                     f"warps={wp} stages={st}") for m, n, wp, st in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))
                    if m % n == 0]
    best = None
    for splits, cfg, note in settings:
        fn = triton_decode(w, splits, cfg) if kind == "decode" else triton_extend(w, cfg)
        try:
            row = measure(w, kind, case, "triton-sweep-best", fn, reference, note)
        except Exception as exc:  # noqa: BLE001 - shared memory or registers the GPU does not have
            print(f"  skip {note}: {type(exc).__name__}")
            continue
        best = row if best is None or row["us"] < best["us"] else best
    return best


def flashinfer_row(fi, w: Workload, workspace, kind: str, case: str, fi_kind: str, reference) -> dict | None:
    """FlashInfer's `fi_kind` measured, or None (said) where it cannot run this case (an FP8 pool
    under a FlashInfer build without that kernel)."""
    try:
        return measure(w, kind, case, f"flashinfer-{fi_kind}", flashinfer_call(fi, w, workspace, fi_kind), reference)
    except Exception as exc:  # noqa: BLE001 - reported, and the other rows still come
        if not w.kv_fp8:
            raise
        print(f"  skip flashinfer-{fi_kind} over fp8 K/V: {type(exc).__name__}: {str(exc)[:200]}")
        return None


def bench_case(fi, workspace, kind: str, batch: int, prefix: int, new: int, ns: argparse.Namespace) -> list[dict]:
    """One case: triton with its default launch settings (over an FP8 pool also with bf16's, the
    settings before they depended on the element size), the sweep's best (--sweep), FlashInfer's."""
    from backplane.plugins.attention_triton.configs import choose_num_kv_splits, decode_config, extend_config

    w, device = Workload(batch, prefix, new, ns.head_dim, kv_dtype=KV_DTYPES[ns.kv_dtype]), torch.device("cuda")
    kv_bytes = w.k_buffer.element_size()
    case = f"bs={batch} ctx={prefix + new}" if kind == "decode" else f"{batch}x({prefix}+{new})"
    splits = choose_num_kv_splits(batch, KV_HEADS, prefix + new, device, 64, kv_bytes=kv_bytes) if kind == "decode" else 0
    cfg = decode_config(ns.head_dim, device, kv_bytes) if kind == "decode" else extend_config(ns.head_dim, DTYPE, device)
    fn = triton_decode(w, splits) if kind == "decode" else triton_extend(w)
    reference = fn().clone()
    rows = [measure(w, kind, case, "triton", fn, None, f"splits={splits} {cfg}")]
    if kind == "decode" and kv_bytes != 2:  # before/after: the 2-byte settings over the same data
        old = decode_config(ns.head_dim, device, 2)
        rows.append(measure(w, kind, case, "triton-2B-settings", triton_decode(w, splits, old), reference,
                            f"splits={splits} {old}"))
    if ns.sweep:
        rows.append(sweep(w, kind, case, reference, splits))
    fi_kinds = (["decode", "decode-tc"] if kind == "decode" else ["prefill"]) if fi else []
    rows += [flashinfer_row(fi, w, workspace, kind, case, k, reference) for k in fi_kinds]
    rows = [r for r in rows if r is not None]
    best_fi = min((r["us"] for r in rows if r["impl"].startswith("flashinfer")), default=None)
    return [r | {"vs_flashinfer": report.ratio(best_fi, r["us"])} for r in rows]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = report.parser(__doc__, device=False)
    p.add_argument("--sweep", action="store_true", help="also the best of the triton kernels' launch settings")
    p.add_argument("--only", choices=("decode", "extend"))
    p.add_argument("--head-dim", type=int, default=128, help="128: llama-3.1-8b; 64: llama-3.2-1b")
    p.add_argument("--decode-cases", nargs="+", default=["1x4096", "16x4096", "64x4096", "256x1024"], metavar="BSxCONTEXT")
    p.add_argument("--kv-dtype", choices=tuple(KV_DTYPES), default="bf16",
                   help="the KV pool's element type; fp8_e4m3 runs the decode cases only")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    ns = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.attention needs a CUDA GPU")
    try:
        import flashinfer as fi
    except ImportError:
        fi = None
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    decode = [("decode", int(b), int(c) - 1, 1) for b, c in (case.split("x") for case in ns.decode_cases)]
    fp8 = ns.kv_dtype == "fp8_e4m3"
    extend = [] if fp8 else [("extend", *case) for case in EXTEND_CASES]
    cases = [c for c in decode + extend if ns.only in (None, c[0])]
    rows = []
    for case in cases:  # each case's rows as it ends: a run stopped at its deadline still shows the ones done
        done = bench_case(fi, workspace, *case, ns)
        rows += done
        print(report.table(done, COLUMNS), flush=True)
    meta = {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": ns.head_dim, "kv_dtype": ns.kv_dtype, "peak_tb_s": copy_tb_s()}
    subject = f"{ns.only or 'all'}-hd{ns.head_dim}" + ("-fp8kv" if fp8 else "")
    report.write_result("attention", subject, {"args": vars(ns), **meta, "rows": rows}, ns.out)
    note = f"; K/V {ns.kv_dtype} (scale {KV_SCALE}), decode only: extend cases skipped" if fp8 else ""
    print(report.table(rows, COLUMNS, f"peak for roofline {meta['peak_tb_s']:.2f} TB/s (measured copy){note}"))
    return rows


if __name__ == "__main__":
    main()
