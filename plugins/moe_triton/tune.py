"""Tune the MoE kernels' launch configurations on this GPU and write the table configs.py reads.

For each layer shape and token count: random routing (top-k of random logits); for each block
height the layout is built once, then gate_up and down launches are checked against the rule of
thumb's result (h and out_pairs are indexed by pair, so every layout must give the same rows) and
timed inside a CUDA graph with L2 flushed before each replay (weights come from HBM, as in a model
step); the fastest pair of launches per block height, then the fastest block height (align +
gate_up + down), is kept.

Which launches: at block height 16 (decode sizes: about one pair per expert, so each GEMM streams
its experts' weights and wants many programs and many bytes in flight) the fields range over DECODE_AXES
(block_n 16-128, block_k 64-512, 2-8 warps, 2-5 stages), searched coordinate-wise from the rule of
thumb (local_search: each field in turn over its values, the others kept, until a pass changes
nothing; --full tries their whole product instead, about ten times as many); taller blocks try the
whole of `launches`' product. Launches over SMEM_BYTES of shared memory are skipped. No split-K: the
kernels have none (K is 2048 or 768 at these shapes; block_n 16 already gives the one-token gate_up
8 x 48 programs).

    python -m backplane.plugins.moe_triton.tune --out NVIDIA_H200.json                 # Qwen3-30B-A3B, TP 1 and 2
    python -m backplane.plugins.moe_triton.tune --shapes 128,2048,768,8 --tokens 1 8 64 --out t.json
    python -m backplane.plugins.moe_triton.tune --defaults --device-name "NVIDIA H100 80GB HBM3" --out x.json
    # quick, decode sizes only (DECODE_TOKENS; under about 3 minutes on an H100, bench.run's moe-bs1):
    python -m backplane.plugins.moe_triton.tune --shapes qwen3-30b-a3b --tokens 1 2 4 8 16 32 --budget 150 --out t.json

Copy the file to plugins/moe_triton/configs/<GPU name, spaces as underscores>.json (the name is
printed), or point an engine at it with --triton-moe.configs (bench.moe_decode and bench.moe_layer:
--moe-configs). --defaults writes the rule of thumb's configurations as an untuned table, without a
GPU. The table is written again after every token count, so a run cut short keeps what it measured;
--budget also stops a search under way (its entry keeps the best launch found so far).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from backplane.testing import cold_graph_us
from backplane.plugins.moe_triton import configs
from backplane.plugins.moe_triton.configs import Config
from backplane.plugins.moe_triton.gemm import Launch

# name -> (E, H, I per partition, top_k)
SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 8), "qwen3-30b-a3b-tp2": (128, 2048, 384, 8),
          "mixtral-8x7b": (8, 4096, 14336, 2), "qwen1.5-moe-a2.7b": (60, 2048, 1408, 4)}
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
DECODE_TOKENS = (1, 2, 4, 8, 16, 32)  # the quick run's (the module docstring)
# block height 16: each field's values (group_m stays 1: a block per expert, no weight tile to share)
DECODE_AXES = {"block_n": (16, 32, 64, 128), "block_k": (64, 128, 256, 512), "num_warps": (2, 4, 8),
               "num_stages": (2, 3, 4, 5)}
MAX_PASSES = 3  # local_search's passes over the fields at most
SMEM_BYTES = 200 << 10  # below the H100/H200's 227 KB per block, with room for the compiler's own
L2_FLUSH_BYTES = 256 << 20


@dataclass(frozen=True)
class Shape:
    num_experts: int
    hidden: int
    intermediate: int
    top_k: int

    @classmethod
    def parse(cls, text: str) -> Shape:
        if text in SHAPES:
            return cls(*SHAPES[text])
        try:
            return cls(*(int(v) for v in text.split(",")))
        except (TypeError, ValueError):
            raise SystemExit(f"--shapes: {text!r} is not a shape; expected E,H,I,k or one of {', '.join(SHAPES)}") from None


def fits(launch: Launch, block_m: int, multiplier: int, elem: int) -> bool:
    """Whether the launch's pipelined tiles fit in SMEM_BYTES; multiplier: weight tiles per K step
    (2 for gate_up, which loads gate and up)."""
    return launch.num_stages * (block_m + multiplier * launch.block_n) * launch.block_k * elem <= SMEM_BYTES


def launches(block_m: int, multiplier: int, elem: int, full: bool):
    """The exhaustive search space of one GEMM at this block height (at height 16 with `full`, the
    product of DECODE_AXES)."""
    if block_m == 16 and full:
        space = itertools.product(*DECODE_AXES.values(), (1,))
    else:
        space = itertools.product((32, 64, 128), (64, 128, 256) if full else (64, 128), (4, 8),
                                  (2, 3, 4, 5) if full else (3, 4), (1, 8) if full else (8,))
    for block_n, block_k, warps, stages, group_m in space:
        launch = Launch(block_n, block_k, group_m, warps, stages)
        if fits(launch, block_m, multiplier, elem):
            yield launch


def local_search(measure, start: Launch, axes: dict[str, tuple], fit) -> tuple[float, Launch]:
    """(µs, launch) of the fastest launch found coordinate-wise from `start`: each field of `axes` in
    turn set to each of its values (the other fields kept, launches that do not `fit` skipped), the
    fastest kept, until a pass over the fields changes nothing (MAX_PASSES at most). measure(launch)
    -> µs (inf for one that fails); each launch is measured once."""
    seen: dict[Launch, float] = {}

    def us(launch: Launch) -> float:
        if launch not in seen:
            seen[launch] = measure(launch)
        return seen[launch]

    best = start
    for _ in range(MAX_PASSES):
        before = best
        for name, values in axes.items():
            for value in values:
                candidate = dataclasses.replace(best, **{name: value})
                if fit(candidate) and us(candidate) < us(best):
                    best = candidate
        if best == before:
            break
    return us(best), best


def block_heights(num_tokens: int, shape: Shape) -> list[int]:
    """Heights worth trying: up to four times the pairs an expert gets on average (at least 16)."""
    per_expert = num_tokens * shape.top_k / shape.num_experts
    return [m for m in configs.BLOCK_MS if m == 16 or m <= 4 * per_expert]


class Case:
    """One shape at one token count: weights, inputs, routing, and a backend whose launches we set."""

    def __init__(self, shape: Shape, num_tokens: int, dtype: torch.dtype, seed: int = 0):
        from backplane.contracts import MoeBackendContext
        from backplane.plugins.moe_triton.backend import TritonMoeBackend

        gen = torch.Generator(device="cuda").manual_seed(seed)
        e, h, i, k = shape.num_experts, shape.hidden, shape.intermediate, shape.top_k
        dt = dict(device="cuda", generator=gen)
        self.shape, self.num_tokens, self.dtype = shape, num_tokens, dtype
        self.w13 = (torch.randn(e, 2 * i, h, **dt) / h**0.5).to(dtype)
        self.w2 = (torch.randn(e, h, i, **dt) / i**0.5).to(dtype)
        self.x = torch.randn(num_tokens, h, **dt).to(dtype)
        weights, ids = torch.softmax(torch.randn(num_tokens, e, **dt), -1).topk(k, -1)
        self.weights, self.ids = (weights / weights.sum(-1, keepdim=True)).contiguous(), ids.to(torch.int32).contiguous()
        ctx = MoeBackendContext(dtype=dtype, device=torch.device("cuda"), max_num_tokens=num_tokens)
        self.backend = TritonMoeBackend(ctx)
        self.ws = self.backend._workspace(_sizes(shape, num_tokens), dtype)

    def layout(self, block_m: int) -> int:
        from backplane.plugins.moe_triton import align

        ws = self.ws
        return align.align(self.ids, self.shape.num_experts, block_m, ws.sorted_ids, ws.expert_ids,
                           ws.num_post_padded, ws.chunk_counts)

    def gate_up(self, block_m: int, num_blocks: int, launch: Launch) -> torch.Tensor:
        from backplane.plugins.moe_triton import gemm

        h, _ = self.views()
        gemm.gate_up(self.x, self.w13, h, self.ws.sorted_ids, self.ws.expert_ids, self.ws.num_post_padded,
                     self.shape.top_k, num_blocks, block_m, launch)
        return h

    def down(self, block_m: int, num_blocks: int, launch: Launch) -> torch.Tensor:
        from backplane.plugins.moe_triton import gemm

        h, out = self.views()
        gemm.down(h, self.w2, self.weights.view(-1), out, self.ws.sorted_ids, self.ws.expert_ids,
                  self.ws.num_post_padded, self.num_tokens * self.shape.top_k, num_blocks, block_m, launch)
        return out

    def views(self):
        return self.ws.views(self.num_tokens * self.shape.top_k, self.shape.intermediate, self.shape.hidden)


def _sizes(shape: Shape, num_tokens: int):
    from backplane.plugins.moe_triton.backend import Sizes

    return Sizes(num_tokens, shape.top_k, shape.num_experts, shape.hidden, shape.intermediate)


def _measure(gemm_fn, block_m: int, num_blocks: int, want: torch.Tensor, flush, deadline: float,
             launch: Launch) -> float:
    """µs of one launch; inf when it fails, its result differs from `want`, or the deadline (monotonic) has passed."""
    if time.monotonic() > deadline:
        return math.inf
    try:
        got = gemm_fn(block_m, num_blocks, launch).clone()
    except Exception as exc:  # noqa: BLE001 - a launch the compiler or the card refuses (resources)
        print(f"    skip {launch}: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
        return math.inf
    if not torch.allclose(got.float(), want.float(), atol=3e-2, rtol=3e-2):
        print(f"    WRONG result, dropped: block_m {block_m} {launch}", flush=True)
        return math.inf
    return cold_graph_us(lambda: gemm_fn(block_m, num_blocks, launch), flush)


def _best(gemm_fn, block_m: int, num_blocks: int, multiplier: int, full: bool, want: torch.Tensor, flush,
          fallback: Launch, deadline: float = math.inf) -> tuple[float, Launch]:
    """(µs, launch) of the fastest launch whose result matches `want` ((inf, fallback) when none does):
    local_search over DECODE_AXES from `fallback` at block height 16 (unless `full`), else every launch."""
    elem = want.element_size()

    def measure(launch: Launch) -> float:
        return _measure(gemm_fn, block_m, num_blocks, want, flush, deadline, launch)

    if block_m == 16 and not full:
        found = local_search(measure, fallback, DECODE_AXES, lambda launch: fits(launch, block_m, multiplier, elem))
    else:
        found = min(((measure(launch), launch) for launch in launches(block_m, multiplier, elem, full)),
                    key=lambda t: t[0], default=(math.inf, fallback))
    return found if math.isfinite(found[0]) else (math.inf, fallback)


def tune_case(case: Case, full: bool, flush: torch.Tensor, deadline: float = math.inf) -> tuple[Config, float, float]:
    """(best config, its µs, the rule of thumb's µs) at one shape and token count; past the deadline
    (monotonic seconds) no further launch is measured."""
    default = configs.default_config(case.num_tokens, case.shape.top_k, case.shape.num_experts, case.dtype)

    def layer_us(config: Config) -> float:
        def run():
            blocks = case.layout(config.block_m)
            case.gate_up(config.block_m, blocks, config.gate_up)
            case.down(config.block_m, blocks, config.down)
        return cold_graph_us(run, flush)

    blocks = case.layout(default.block_m)  # the reference rows: layout-independent, indexed by pair
    want_h = case.gate_up(default.block_m, blocks, default.gate_up).clone()
    want_out = case.down(default.block_m, blocks, default.down).clone()
    results = []
    for block_m in block_heights(case.num_tokens, case.shape):
        blocks = case.layout(block_m)
        _, gate_up = _best(case.gate_up, block_m, blocks, 2, full, want_h, flush, default.gate_up, deadline)
        case.views()[0].copy_(want_h)  # down reads the right h whatever the last candidate wrote
        _, down = _best(case.down, block_m, blocks, 1, full, want_out, flush, default.down, deadline)
        config = Config(block_m, gate_up, down)
        results.append((layer_us(config), config))
        print(f"  T {case.num_tokens} block_m {block_m}: {results[-1][0]:.1f} µs", flush=True)
    us, best = min(results, key=lambda r: r[0])
    return best, us, layer_us(default)


def write(path: Path, device: str, tuned: bool, entries: list[dict]) -> None:
    """The table as JSON, one entry a line; the versions it was measured with (none when untuned)."""
    import triton

    head = {"device": device, "tuned": tuned, "triton": triton.__version__ if tuned else None,
            "torch": torch.__version__.split("+")[0] if tuned else None}
    lines = ",\n".join("  " + json.dumps(e) for e in entries)
    path.write_text(json.dumps(head, indent=1)[:-2] + ',\n "entries": [\n' + lines + "\n ]\n}\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="the table to write (JSON)")
    p.add_argument("--shapes", nargs="+", default=["qwen3-30b-a3b", "qwen3-30b-a3b-tp2"],
                   help=f"E,H,I,k or a name: {', '.join(SHAPES)}")
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument("--full", action="store_true", help="every launch of the larger search space (about 8x the launches)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds: no launch is measured and no token count started after this")
    p.add_argument("--defaults", action="store_true", help="write the rule of thumb's configs as an untuned table")
    p.add_argument("--device-name", default=None, help="with --defaults: the device the table is for")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    ns = parse_args(argv)
    dtype, shapes, out = getattr(torch, ns.dtype), [Shape.parse(s) for s in ns.shapes], Path(ns.out)
    keys = [(s, configs.shape_key(dtype, s.num_experts, s.intermediate, s.hidden)) for s in shapes]
    if ns.defaults:
        entries = [configs.entry(key, t, configs.default_config(t, s.top_k, s.num_experts, dtype))
                   for s, key in keys for t in sorted(ns.tokens)]
        write(out, ns.device_name or "unknown", False, entries)
        print(f"wrote {len(entries)} untuned entries to {out}")
        return
    if not torch.cuda.is_available():
        raise SystemExit("tune: needs a CUDA GPU (or --defaults)")
    device, entries = torch.cuda.get_device_name(), []
    deadline = time.monotonic() + (ns.budget if ns.budget is not None else math.inf)
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    for (shape, key), num_tokens in itertools.product(keys, sorted(ns.tokens)):
        if time.monotonic() > deadline:
            print(f"budget spent: stopping before {shape} at {num_tokens} tokens", flush=True)
            break
        best, us, default_us = tune_case(Case(shape, num_tokens, dtype), ns.full, flush, deadline)
        entries.append({**configs.entry(key, num_tokens, best, round(us, 2)), "default_us": round(default_us, 2)})
        print(f"{shape} T {num_tokens}: {us:.1f} µs (rule of thumb {default_us:.1f} µs) {best}", flush=True)
        write(out, device, True, entries)
    print(f"wrote {out}; copy it to plugins/moe_triton/configs/{configs.device_file_name(device)}")


if __name__ == "__main__":
    main()
