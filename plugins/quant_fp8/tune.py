"""Tune quant_fp8's GEMM launches on this GPU and write the table cuda.py reads.

For each token count, kernel ("channel": per-channel weight and per-token activation scales;
"block": 128 x 128 weight blocks) and weight shape (N, K): every launch of a pruned search space is
checked against the default launch's result (a fast wrong launch is dropped) and timed inside a
CUDA graph with L2 flushed before each replay (the weight comes from HBM, as in a model step); the
fastest is kept. For "channel", torch._scaled_mm row-wise (its activation quantization included) and
tensor-wise (cuda.tensorwise: scales of 1, then the scale kernel) are timed too: where one is faster,
the entry says "use": "scaled_mm" or "tensorwise" and cuda.py sends GEMMs of that token bucket there. Up to kernels.GEMV_MAX_ROWS tokens the GEMV launches (no tl.dot) are
candidates too; those entries also record the fastest tl.dot and GEMV launches' µs ("dot_us",
"gemv_us"). Token counts run smallest first; the table is written again after every case, so a run
cut short (--budget) keeps what it measured.

    python -m backplane.plugins.quant_fp8.tune --out NVIDIA_H100_80GB_HBM3.json --budget 480  # llama-3.1-8b
    python -m backplane.plugins.quant_fp8.tune --shapes 6144,4096 --tokens 1 16 --kernels channel --out t.json
    python -m backplane.plugins.quant_fp8.tune --defaults --device-name "NVIDIA H200" --out x.json
    python -m backplane.plugins.quant_fp8.tune --tokens 1 8 --update bundled --out t.json  # decode sizes again, the rest kept

Copy the file to plugins/quant_fp8/configs/<GPU name, spaces as underscores>.json (the name is
printed). --defaults writes default_launch's choices as an untuned table, without a GPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch
import triton

from backplane.testing import cold_graph_us
from backplane.plugins.quant_fp8 import cuda
from backplane.plugins.quant_fp8 import quantize as fq
from backplane.plugins.quant_fp8.kernels import (GEMV_MAX_ROWS, Launch, block_m_for, block_matmul, channel_matmul,
                                                 new_counters)
from backplane.plugins.quant_fp8.scheme import Fp8Scheme

# name -> the (N, K) of each linear: qkv, o, gate_up, down
SHAPES = {"llama-3.1-8b": ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)),
          "llama-3.2-1b": ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)),
          "qwen3-8b": ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288))}
TOKENS = (1, 8, 16, 32, 64, 128)
BLOCK = (128, 128)  # the weight blocks of block-wise FP8 checkpoints
SMEM_BYTES = 200 << 10  # below the H100/H200's 227 KB per block, with room for the compiler's own
FUSE_MAX_BYTES = 64 << 10  # x larger than this is not tried quantized inside the channel GEMM
L2_FLUSH_BYTES = 256 << 20
CHANNEL = Fp8Scheme(weights="channel", activations="token")


def launches(kernel: str, m: int, n: int, k: int, num_sms: int, full: bool):
    """The search space at M rows: decode sizes try narrow tiles, split K and x quantized inside the
    GEMM; larger M wider tiles and more warps, one K slice. --full adds pipeline depths, warps, splits.
    Up to GEMV_MAX_ROWS rows the GEMV launches (gemv_launches) follow."""
    yield from _dot_launches(kernel, m, n, k, num_sms, full)
    if m <= GEMV_MAX_ROWS:
        yield from gemv_launches(kernel, m, n, k, num_sms, full)


def _splits(decode: bool, full: bool) -> tuple[int, ...]:
    return ((1, 2, 3, 4, 6, 8, 12, 16) if full else (1, 2, 3, 4, 6, 8)) if decode else (1,)


def _too_many_splits(n: int, k: int, block_n: int, block_k: int, split: int, num_sms: int) -> bool:
    """More than 8 programs per SM, or fewer than 2 K steps per slice."""
    return split > 1 and (triton.cdiv(n, block_n) * split > 8 * num_sms or triton.cdiv(k, block_k) // split < 2)


def gemv_launches(kernel: str, m: int, n: int, k: int, num_sms: int, full: bool):
    """The GEMV launches at M <= GEMV_MAX_ROWS: weight tiles of 16 to 128 columns by 128 to 512
    (block: the weight block's) K columns, split K as the tl.dot launches, 4 or 8 warps; each thread
    loads 16 to 128 weight bytes per K step (at least one 16-byte load; --full: up to 256). Pipeline
    depth 1 (each K step waits for its tile) or 2 (the next step's tile prefetched into registers;
    deeper is the same kernel), 2 only up to 64 bytes a thread (it held one 32-bit register per
    prefetched byte when compiled for sm_90; --full: always). At least one program per SM. x is
    quantized inside the GEMV where the tl.dot launches may (--full: also before it)."""
    block_ks = (BLOCK[1],) if kernel == "block" else (128, 256, 512)
    fusable = kernel == "block" or m * k * 2 <= FUSE_MAX_BYTES
    fuses = (False, True) if full and fusable else (fusable,)
    space = itertools.product((16, 32, 64, 128), block_ks, _splits(True, full), (4, 8), (1, 2), fuses)
    for block_n, block_k, split, warps, stages, fuse in space:
        per_thread = block_n * block_k // (32 * warps)
        if not 16 <= per_thread <= (256 if full else 128) or (stages > 1 and per_thread > 64 and not full):
            continue
        programs = triton.cdiv(n, block_n) * split
        if programs < num_sms or _too_many_splits(n, k, block_n, block_k, split, num_sms):
            continue  # an SM without a program cannot stream its share of the weight
        yield Launch(block_n, block_k, split, warps, stages, fuse, gemv=True)


def _dot_launches(kernel: str, m: int, n: int, k: int, num_sms: int, full: bool):
    decode = m <= cuda.DECODE_MAX_TOKENS
    block_ks = (BLOCK[1],) if kernel == "block" else ((128, 256, 512) if full else (128, 256))
    splits = _splits(decode, full)
    space = itertools.product((32, 64, 128) if decode else (64, 128, 256), block_ks, splits,
                              (4, 8) if full or not decode else (4,), (2, 3, 4, 5) if full else (4,),
                              (False, True) if decode else (False,))
    block_m = block_m_for(m)
    for block_n, block_k, split, warps, stages, fuse in space:
        x_bytes = 2 if fuse else 1
        if stages * (block_m * block_k * x_bytes + block_k * block_n) > SMEM_BYTES:
            continue
        if _too_many_splits(n, k, block_n, block_k, split, num_sms):
            continue
        if fuse and kernel == "channel" and m * k * 2 > FUSE_MAX_BYTES:
            continue
        yield Launch(block_n, block_k, split, warps, stages, fuse)


class Case:
    """One GEMM to tune: a random FP8 weight [N, K] with its scales, bf16 x [M, K], the counters."""

    def __init__(self, key: cuda.TableKey, m: int, seed: int = 0):
        kernel, n, k, block = key
        gen = torch.Generator(device="cuda").manual_seed(seed)
        w = torch.randn(n, k, device="cuda", generator=gen) / k**0.5
        self.key, self.m = key, m
        self.weight, self.scale = fq.quantize_weight_blocks(w, *block) if block else fq.quantize_weight_per_channel(w)
        self.x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        self.counters = new_counters(self.weight)

    def run(self, launch: Launch) -> torch.Tensor:
        if self.key[0] == "block":
            return block_matmul(self.x, self.weight, self.scale, self.key[3], None, launch, self.counters)
        return channel_matmul(self.x, self.weight, self.scale, None, launch, self.counters)

    def scaled_mm(self) -> torch.Tensor:
        return cuda._rowwise(CHANNEL, self.x, self.weight, self.scale, None, None)

    def tensorwise(self) -> torch.Tensor:
        return cuda.tensorwise(CHANNEL, self.x, self.weight, self.scale, None, None)


def tune_case(case: Case, num_sms: int, full: bool, flush: torch.Tensor) -> dict:
    """The table entry of one case: the fastest launch that gives the default launch's result, its µs,
    the default's, (up to GEMV_MAX_ROWS tokens) the fastest tl.dot and GEMV launches', and (channel)
    _scaled_mm's."""
    kernel, n, k, _ = case.key
    default = cuda.default_launch(case.key, case.m, 2, num_sms)
    want = case.run(default).float()
    timed = [(cold_graph_us(lambda: case.run(default), flush), default)]
    for launch in launches(kernel, case.m, n, k, num_sms, full):
        try:
            got = case.run(launch).float()
        except Exception as exc:  # noqa: BLE001 - a launch the compiler or the card refuses (resources)
            print(f"    skip {launch}: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
            continue
        if not torch.allclose(got, want, atol=2e-2, rtol=2e-2):
            print(f"    WRONG result, dropped: {launch}", flush=True)
            continue
        timed.append((cold_graph_us(lambda launch=launch: case.run(launch), flush), launch))
    us, best = min(timed, key=lambda t: t[0])
    timings = {"us": round(us, 2), "default_us": round(timed[0][0], 2)}
    if case.m <= GEMV_MAX_ROWS:  # how the two kinds of launch compare, whichever won
        for name, gemv in (("dot_us", False), ("gemv_us", True)):
            fastest = min((t for t, launch in timed if launch.gemv == gemv), default=None)
            timings[name] = None if fastest is None else round(fastest, 2)  # None: every GEMV launch failed
    use = "triton"
    if kernel == "channel":  # torch._scaled_mm row-wise, and tensor-wise with the scale kernel after it
        timings["scaled_mm_us"] = round(cold_graph_us(case.scaled_mm, flush), 2)
        if torch.allclose(case.tensorwise().float(), want, atol=2e-2, rtol=2e-2):
            timings["tensorwise_us"] = round(cold_graph_us(case.tensorwise, flush), 2)
        else:
            print("    WRONG result, dropped: tensorwise", flush=True)
        others = [(t, name) for name in ("scaled_mm", "tensorwise") if (t := timings.get(f"{name}_us")) is not None]
        use = min([(us, "triton"), *others])[1]
    return cuda.entry(case.key, case.m, use, best, **timings)


def write(path: Path, device: str, tuned: bool, entries: list[dict]) -> None:
    """The table as JSON, one entry a line; the versions it was measured with (none when untuned)."""
    head = {"device": device, "tuned": tuned, "triton": triton.__version__ if tuned else None,
            "torch": torch.__version__.split("+")[0] if tuned else None}
    lines = ",\n".join("  " + json.dumps(e) for e in entries)
    path.write_text(json.dumps(head, indent=1)[:-2] + ',\n "entries": [\n' + lines + "\n ]\n}\n")


def parse_shape(text: str) -> list[tuple[int, int]]:
    if text in SHAPES:
        return list(SHAPES[text])
    try:
        n, k = (int(v) for v in text.split(","))
    except ValueError:
        raise SystemExit(f"--shapes: {text!r} is not a shape; expected N,K or one of {', '.join(SHAPES)}") from None
    return [(n, k)]


def keys(ns: argparse.Namespace) -> list[cuda.TableKey]:
    shapes = list(dict.fromkeys(s for text in ns.shapes for s in parse_shape(text)))
    return [(kernel, n, k, BLOCK if kernel == "block" else None) for kernel in ns.kernels for n, k in shapes]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="the table to write (JSON)")
    p.add_argument("--shapes", nargs="+", default=["llama-3.1-8b"], help=f"N,K or a name: {', '.join(SHAPES)}")
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    p.add_argument("--kernels", nargs="+", choices=cuda.KERNELS, default=list(cuda.KERNELS))
    p.add_argument("--full", action="store_true", help="the larger search space (about 8x the launches)")
    p.add_argument("--budget", type=float, default=None, help="seconds: no new case is started after this")
    p.add_argument("--defaults", action="store_true", help="write default_launch's choices as an untuned table")
    p.add_argument("--device-name", default=None, help="with --defaults: the device the table is for")
    p.add_argument("--sms", type=int, default=132, help="with --defaults: the device's SM count")
    p.add_argument("--update", default=None, metavar="PATH|bundled",
                   help="start from this table (bundled: this GPU's file in configs/): the cases tuned now replace "
                        "its entries of the same kernel, shape and token count, the rest are kept")
    return p.parse_args(argv)


def entry_key(e: dict) -> tuple:
    """What a table entry is for: kernel, N, K, weight block and token count."""
    return e["kernel"], e["N"], e["K"], tuple(e.get("block") or ()), e["tokens"]


def merged(base: list[dict], tuned: list[dict]) -> list[dict]:
    """`base`'s entries with those `tuned` measured again replaced in place, then the new ones."""
    fresh = {entry_key(e): e for e in tuned}
    kept = [fresh.pop(entry_key(e), e) for e in base]
    return kept + list(fresh.values())


def base_entries(update: str | None, device: str) -> list[dict]:
    """The entries --update starts from (checked as cuda.py reads them); none without it."""
    if update is None:
        return []
    path = cuda.CONFIG_DIR / cuda.device_file_name(device) if update == "bundled" else Path(update)
    if update == "bundled" and not path.exists():
        print(f"--update bundled: no table for {device} in {cuda.CONFIG_DIR.name}/; starting empty", flush=True)
        return []
    cuda.load_table(path, option="--update")  # a one-line error for a file cuda.py would refuse
    return json.loads(path.read_text())["entries"]


def main(argv: list[str] | None = None) -> None:
    ns = parse_args(argv)
    out, cases = Path(ns.out), [(m, key) for m in sorted(ns.tokens) for key in keys(ns)]
    if ns.defaults:
        entries = [cuda.entry(key, m, "triton" if m <= cuda.DECODE_MAX_TOKENS or key[0] == "block" else "scaled_mm",
                              cuda.default_launch(key, m, 2, ns.sms)) for m, key in cases]
        write(out, ns.device_name or "unknown", False, entries)
        print(f"wrote {len(entries)} untuned entries to {out}")
        return
    if not torch.cuda.is_available():
        raise SystemExit("tune: needs a CUDA GPU (or --defaults)")
    device, began, entries = torch.cuda.get_device_name(), time.monotonic(), []
    base = base_entries(ns.update, device)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    for m, key in cases:
        if ns.budget is not None and time.monotonic() - began > ns.budget:
            print(f"budget spent: stopping before {key} at {m} tokens", flush=True)
            break
        entries.append(tune_case(Case(key, m), num_sms, ns.full, flush))
        e = entries[-1]
        print(f"{key[0]} N {key[1]} K {key[2]} M {m}: {e['us']:.1f} µs (default {e['default_us']:.1f}, "
              f"tl.dot {e.get('dot_us', '-')}, GEMV {e.get('gemv_us', '-')}, _scaled_mm {e.get('scaled_mm_us', '-')}) use {e['use']} {Launch(**{f: e[f] for f in cuda._LAUNCH_FIELDS})}",
              flush=True)
        write(out, device, True, merged(base, entries))
    print(f"wrote {out} ({len(merged(base, entries))} entries, {len(entries)} tuned now); copy it to plugins/quant_fp8/configs/{cuda.device_file_name(device)}")


if __name__ == "__main__":
    main()
