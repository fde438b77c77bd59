"""The MoE layer alone (router + experts) at Qwen3-30B-A3B shapes: the core's FusedMoE on the
moe_triton backend and on torch_native, against a plain-PyTorch layer under torch.compile (the peer,
gpt-fast's MOEFeedForward shape), at each token count, in one run; with the read floor (the
distinct chosen experts' weights at the card's copy bandwidth).

Times are medians of L2-cold calls (bench/timing.time_cold: replays of a CUDA graph, L2 flushed
before each, so the weights come from HBM as in a model step; torch_native syncs with the host and
cannot be captured, so it is timed eagerly the same way), plus a warm-L2 column for triton. Every
output is checked against torch_native first: a fast wrong layer is no result.

The peer gathers each token's experts' weights and contracts them with einsum (w1[ids] etc.) as
gpt-fast does for decode; where the gathered weights would pass PEER_GATHER_BYTES (256 tokens and
up at these shapes) it computes every expert on every token and gathers the chosen outputs instead
(dense), the plain-PyTorch way with static shapes. Its column says which.

    python -m bench.moe_layer                       # 1 8 32 256 2048 tokens, bf16, on CUDA
    python -m bench.moe_layer --tokens 1 8 --no-peer
    python -m bench.moe_layer --tokens 1 8 --no-peer --moe-configs t.json   # a table tune.py wrote, not the bundled one
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from bench import report
from bench.timing import L2_FLUSH_BYTES, copy_tb_s, time_cold, time_graph, time_us

QWEN3_30B_A3B = (128, 2048, 768, 8)  # experts, hidden, intermediate, top-k
PEER_GATHER_BYTES = 4 << 30
COLUMNS = [("T", "tokens", "d"), ("experts", "distinct_experts", "d"), ("triton", "triton_us", ".1f"),
           ("warm", "triton_warm_us", ".1f"), ("native", "native_us", ".1f"), ("mode", "native_mode", ""),
           ("peer", "peer_us", ".1f"), ("peer kind", "peer_kind", ""), ("x native", "x_native", ".2f"),
           ("x peer", "x_peer", ".2f"), ("floor", "floor_us", ".1f"), ("triton/floor", "triton_vs_floor", ".2f")]


class PeerMoe(torch.nn.Module):
    """gpt-fast's MOEFeedForward on the FusedMoE's weights: x [T, H] -> [T, H]. The router: softmax
    in fp32, top-k, renormalised; the experts either gathered per token (w1[ids]: [T, k, I, H]) and
    contracted with einsum, or (dense) every expert on every token then the chosen outputs gathered."""

    def __init__(self, layer, dense: bool):
        super().__init__()
        inter = layer.w2_weight.shape[2]
        self.gate, self.top_k, self.dense = layer.gate.weight, layer.top_k, dense
        self.w1, self.w3, self.w2 = layer.w13_weight[:, :inter], layer.w13_weight[:, inter:], layer.w2_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax((x @ self.gate.t()).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        weights = weights / weights.sum(dim=-1, keepdim=True)
        outs = self.dense_experts(x, ids) if self.dense else self.gathered_experts(x, ids)  # [T, k, H]
        return torch.einsum("tah,ta->th", outs.float(), weights).to(x.dtype)

    def gathered_experts(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        w1, w3, w2 = self.w1[ids], self.w3[ids], self.w2[ids]  # [T, k, I, H], [T, k, I, H], [T, k, H, I]
        x1 = F.silu(torch.einsum("th,taih->tai", x, w1))
        x3 = torch.einsum("th,taih->tai", x, w3)
        return torch.einsum("tai,tahi->tah", x1 * x3, w2)

    def dense_experts(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        h = F.silu(torch.einsum("th,eih->eti", x, self.w1)) * torch.einsum("th,eih->eti", x, self.w3)  # [E, T, I]
        y = torch.einsum("eti,ehi->eth", h, self.w2)  # [E, T, H]
        return y[ids, torch.arange(x.shape[0], device=x.device)[:, None]]  # [T, k, H]


def build_layer(shape: tuple[int, int, int, int], device: torch.device, dtype: torch.dtype, max_tokens: int,
                moe_configs: str | None = None):
    """(the core's FusedMoE with random weights, its triton backend, a torch_native backend); the
    triton backend reads the launch table moe_configs (--triton-moe.configs), else the bundled one."""
    from backplane.contracts.moe import MoeBackendContext
    from backplane.layers import FusedMoE
    from backplane.models.base import ModelContext
    from backplane.moe import TorchNativeMoeBackend
    from backplane.plugins.moe_triton.backend import TritonMoeBackend
    from backplane.plugins.moe_triton.options import TritonMoeOptions

    num_experts, hidden, inter, top_k = shape
    ctx = ModelContext(dtype=dtype, device=device)
    with torch.device(device):
        layer = FusedMoE(num_experts, top_k, hidden, inter, ctx, layer_id=0, renormalize=True)
    with torch.no_grad():
        layer.gate.weight.copy_(torch.randn_like(layer.gate.weight) / hidden**0.5)
        layer.w13_weight.copy_(torch.randn_like(layer.w13_weight) / hidden**0.5)
        layer.w2_weight.copy_(torch.randn_like(layer.w2_weight) / inter**0.5)
    options = TritonMoeOptions(configs=moe_configs)
    triton_backend = TritonMoeBackend(MoeBackendContext(dtype=dtype, device=device, max_num_tokens=max_tokens,
                                                        options=options))
    triton_backend.register_layer(layer, layer.moe_info)
    return layer, triton_backend, TorchNativeMoeBackend(None)


def _on(layer, backend):
    """The layer's forward with `backend` as the model's MoE backend."""
    def forward(x):
        layer.ctx.moe_backend = backend
        return layer(x)
    return forward


def _check(got: torch.Tensor, want: torch.Tensor, what: str) -> str | None:
    """None when got matches want (bf16: max |error| <= 3e-2 x max |want|), else why not."""
    err, scale = float((got.float() - want.float()).abs().max()), float(want.float().abs().max())
    return None if err <= 3e-2 * max(scale, 1e-6) else f"{what}: max |error| {err:.3g} against torch_native (scale {scale:.3g})"


def floor_us(layer, ids: torch.Tensor, device: torch.device) -> tuple[int, float]:
    """(distinct experts chosen, µs to read their weights once at the copy bandwidth)."""
    distinct = int(torch.unique(ids).numel())
    per_expert = (layer.w13_weight[0].numel() + layer.w2_weight[0].numel()) * layer.w13_weight.element_size()
    return distinct, distinct * per_expert / (copy_tb_s(device) * 1e12) * 1e6


@torch.inference_mode()
def layer_row(layer, triton_backend, native_backend, num_tokens: int, device: torch.device, peer: bool) -> dict:
    """One token count: each variant checked against torch_native, then timed."""
    from backplane.moe import route

    x = torch.randn(num_tokens, layer.hidden_size, device=device, dtype=layer.w13_weight.dtype)
    triton_fn, native_fn = _on(layer, triton_backend), _on(layer, native_backend)
    want = native_fn(x)
    problem = _check(triton_fn(x), want, f"triton at {num_tokens} tokens")
    if problem:
        raise AssertionError(problem)
    distinct, floor = floor_us(layer, route(layer.gate(x), layer.top_k, True)[1], device)
    native_us, native_mode = _timed_cold(native_fn, x, device, graph=False)  # NOTE: it syncs with the host
    row = {"tokens": num_tokens, "distinct_experts": distinct, "floor_us": floor,
           "triton_us": _timed_cold(triton_fn, x, device)[0], "native_us": native_us, "native_mode": native_mode,
           "triton_warm_us": time_graph(lambda: triton_fn(x)) if device.type == "cuda" else None}
    if peer:
        row.update(peer_row(layer, x, want, device))
    report.add_ratios([row], {"x_native": ("native_us", "triton_us"), "x_peer": ("peer_us", "triton_us"),
                              "triton_vs_floor": ("triton_us", "floor_us")})
    return row


def _timed_cold(fn, x, device: torch.device, graph: bool = True) -> tuple[float, str]:
    """(median µs of fn(x) L2-cold, "graph" or "eager"): time_cold, or with graph=False eager calls
    timed the same way (a layer that syncs with the host is never offered to a capture)."""
    if device.type != "cuda":
        return time_us(lambda: fn(x), device), "eager"
    if graph:
        return time_cold(lambda: fn(x), 60)
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
    fn(x)
    times = []
    for _ in range(20):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times), "eager"


def peer_row(layer, x: torch.Tensor, want: torch.Tensor, device: torch.device) -> dict:
    """The compiled peer at this token count: its kind, its check against torch_native, its time."""
    per_pair = (layer.w13_weight[0].numel() + layer.w2_weight[0].numel()) * layer.w13_weight.element_size()
    dense = x.shape[0] * layer.top_k * per_pair > PEER_GATHER_BYTES
    torch._dynamo.reset()  # one specialisation per token count; earlier ones would pass the recompile limit
    compiled = torch.compile(PeerMoe(layer, dense), fullgraph=True, dynamic=False)
    problem = _check(compiled(x), want, f"peer at {x.shape[0]} tokens")
    us, _ = _timed_cold(compiled, x, device)
    return {"peer_us": us, "peer_kind": "dense" if dense else "gather", "peer_check": problem or "ok"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = report.parser(__doc__)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 256, 2048])
    p.add_argument("--shape", type=int, nargs=4, default=list(QWEN3_30B_A3B), metavar=("E", "H", "I", "K"),
                   help="experts, hidden, intermediate, top-k (default Qwen3-30B-A3B's)")
    p.add_argument("--no-peer", action="store_true", help="skip the compiled plain-PyTorch layer")
    p.add_argument("--moe-configs", default=None, metavar="PATH",
                   help="the moe_triton launch table (--triton-moe.configs); default: the bundled one of this GPU")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    ns = parse_args(argv)
    device = torch.device(ns.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench.moe_layer: --device cuda but no CUDA GPU (--device cpu runs the code path with TRITON_INTERPRET=1)")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    layer, triton_backend, native_backend = build_layer(tuple(ns.shape), device, dtype, max(ns.tokens), ns.moe_configs)
    rows = [layer_row(layer, triton_backend, native_backend, t, device, not ns.no_peer) for t in ns.tokens]
    subject = "qwen3-30b-a3b" if tuple(ns.shape) == QWEN3_30B_A3B else "e{}-h{}-i{}-k{}".format(*ns.shape)
    subject += f"-configs-{Path(ns.moe_configs).stem}" if ns.moe_configs else ""
    table = triton_backend.table
    payload = {"args": vars(ns), "copy_tb_s": copy_tb_s(device), "rows": rows,
               "moe_table": {"source": table.source, "tuned": table.tuned, "entries": len(table)}}
    report.write_result("moe-layer", subject, payload, ns.out, ns.device)
    title = (f"{subject}: one MoE layer (router + experts), µs, L2-cold medians; x native / x peer: their time over "
             "triton's; floor: the chosen experts' weights at the copy bandwidth")
    print(report.table(rows, COLUMNS, title))
    return rows


if __name__ == "__main__":
    main()
