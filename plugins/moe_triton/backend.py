"""TritonMoeBackend: the MoeBackend contract on the kernels of align.py and gemm.py.

apply(x [T, H], topk_weights [T, k], topk_ids [T, k]) runs, per chunk of at most chunk_tokens
tokens:
1. align: the T * k pairs sorted by expert into BLOCK_M-aligned runs (device only). One token
   (decode at bs 1) needs no sort: its k experts are distinct, so pair j is block j of expert
   topk_ids[0, j], and the layout is a fixed one (Workspace.one_token) with topk_ids as the blocks'
   experts: no launch at all, where align is one launch per layer (48 a step for Qwen3-30B-A3B);
2. gate_up: h [T * k, I] = silu(x w_gate^T) * (x w_up^T), per pair with its expert's weights;
3. down: out_pairs [T * k, H] = topk_weight * (h w_down^T);
4. the k-way sum: out [T, H] = out_pairs viewed [T, k, H] summed over k (fp32 accumulation).

The buffers of steps 1-3 are one Workspace per dtype shared by every layer (layers run one after
another), allocated in register_layer (or the first apply) for chunk_tokens = ctx.max_num_tokens
tokens (at most MAX_CHUNK_TOKENS; longer inputs go through in chunks of that many); each call uses
views of them sized by T. Every size and grid depends on T and the layer's shapes only, so a CUDA
graph captured at T replays with any routing.

FP8 experts (`layer.moe_info.quant`, an ExpertQuant of quantization method "fp8"): x is quantized
before step 2 and h before step 3 (backplane.moe.quantize_activations: per token, or per 1 x bk
group for block scales; fixed shapes, so graphs capture it), and both GEMMs run on FP8 operands
with the weights' per-channel or block scales (gemm.Scales); h and the output stay in x's dtype.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton

from backplane.contracts import ExpertQuant, MoeBackend, MoeBackendContext, MoeLayerInfo
from backplane.moe import expert_scales, quantize_activations
from backplane.plugins.moe_triton import align, configs, gemm
from backplane.plugins.moe_triton.configs import Config, ConfigTable
from backplane.plugins.moe_triton.options import TritonMoeOptions

MAX_CHUNK_TOKENS = 8192  # the workspace's tokens at most: out_pairs is [tokens * k, H]
QUANT_METHODS = ("fp8",)  # the plugin's spec declares these (backplane.plugins.moe_triton)


@dataclass(frozen=True)
class Sizes:
    """What a workspace holds: up to num_tokens tokens of any layer with at most these sizes."""

    num_tokens: int
    top_k: int
    num_experts: int
    hidden: int
    intermediate: int

    def covers(self, other: Sizes) -> bool:
        return all(a >= b for a, b in zip(vars(self).values(), vars(other).values()))

    def union(self, other: Sizes) -> Sizes:
        return Sizes(*(max(a, b) for a, b in zip(vars(self).values(), vars(other).values())))


class Workspace:
    """The layout buffers (align.py), h and out_pairs, for every BLOCK_M in configs.BLOCK_MS."""

    def __init__(self, sizes: Sizes, dtype: torch.dtype, device: torch.device):
        self.sizes, self.dtype = sizes, dtype
        pairs, experts = sizes.num_tokens * sizes.top_k, sizes.num_experts
        rows = {m: align.max_padded_rows(pairs, experts, m) for m in configs.BLOCK_MS}
        i32 = dict(dtype=torch.int32, device=device)
        self.sorted_ids = torch.empty(max(rows.values()), **i32)
        self.expert_ids = torch.empty(max(r // m for m, r in rows.items()), **i32)
        self.num_post_padded = torch.zeros(1, **i32)
        self.chunk_counts = torch.empty(align.num_chunks(pairs, experts) * triton.next_power_of_2(experts), **i32)
        self.h = torch.empty(pairs * sizes.intermediate, dtype=dtype, device=device)
        self.out_pairs = torch.empty(pairs * sizes.hidden, dtype=dtype, device=device)
        self.one_token = {m: one_token_layout(sizes.top_k, m, device) for m in configs.BLOCK_MS}

    def views(self, num_pairs: int, intermediate: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(h [num_pairs, intermediate], out_pairs [num_pairs, hidden]), contiguous."""
        return (self.h[: num_pairs * intermediate].view(num_pairs, intermediate),
                self.out_pairs[: num_pairs * hidden].view(num_pairs, hidden))


def one_token_layout(top_k: int, block_m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_ids, num_post_padded) of one token's pairs, for any top-k up to `top_k`: block j holds
    pair j then sentinels (top_k, which is at least any such token's pair count), every block used.
    With the token's topk_ids as the blocks' experts this is align.py's layout up to the order of
    the blocks (the GEMMs index h and out_pairs by pair, so the order does not matter)."""
    sorted_ids = torch.full((top_k * block_m,), top_k, dtype=torch.int32)
    sorted_ids[::block_m] = torch.arange(top_k, dtype=torch.int32)
    return sorted_ids.to(device), torch.tensor([top_k * block_m], dtype=torch.int32, device=device)


class TritonMoeBackend(MoeBackend):
    """Grouped-GEMM MoE in Triton. `config`, when given, is used for every launch (tests, tuning)."""

    def __init__(self, ctx: MoeBackendContext, config: Config | None = None) -> None:
        if ctx.quant is not None and ctx.quant not in QUANT_METHODS:
            raise ValueError(f"moe backend triton: quantization {ctx.quant!r} is not supported; expected unquantized "
                             f"expert weights or one of {', '.join(QUANT_METHODS)} (--quantization), or another "
                             "--moe-backend")
        self.ctx, self.config = ctx, config
        options = ctx.options if isinstance(ctx.options, TritonMoeOptions) else TritonMoeOptions()
        self.table = configs.table_for(ctx.device, options.configs) if options.tuned else ConfigTable()
        self.one_token_layout = options.one_token_layout
        self._workspaces: dict[torch.dtype, Workspace] = {}
        self._retired: list[Workspace] = []  # NOTE: graphs captured before a workspace grew still read these
        self._configs: dict[tuple, Config] = {}
        self.chunk_tokens = min(max(ctx.max_num_tokens, 1), MAX_CHUNK_TOKENS)  # longer inputs go in chunks

    def register_layer(self, layer: torch.nn.Module, info: MoeLayerInfo) -> None:
        if info.quant is not None and info.quant.method not in QUANT_METHODS:
            raise ValueError(f"moe backend triton: layer {info.layer_id}: experts quantized by {info.quant.method!r}; "
                             f"expected one of {', '.join(QUANT_METHODS)}")
        sizes = Sizes(self.chunk_tokens, info.top_k, info.num_experts, info.hidden_size,
                      info.intermediate_size_per_partition)
        self._workspace(sizes, self.ctx.dtype)

    def _workspace(self, sizes: Sizes, dtype: torch.dtype) -> Workspace:
        """The workspace of `dtype`, grown when it does not cover `sizes` (before any capture, normally)."""
        ws = self._workspaces.get(dtype)
        if ws is None or not ws.sizes.covers(sizes):
            if ws is not None:
                self._retired.append(ws)
                sizes = ws.sizes.union(sizes)
            ws = self._workspaces[dtype] = Workspace(sizes, dtype, self.ctx.device)
        return ws

    def launch_config(self, num_tokens: int, top_k: int, num_experts: int, intermediate: int, hidden: int,
                      dtype: torch.dtype) -> Config:
        """The forced config, else the table's entry nearest num_tokens, else configs.default_config."""
        if self.config is not None:
            return self.config
        cache_key = (num_tokens, top_k, num_experts, intermediate, hidden, dtype)
        config = self._configs.get(cache_key)
        if config is None:
            key = configs.shape_key(dtype, num_experts, intermediate, hidden)
            config = self.table.lookup(key, num_tokens) or configs.default_config(num_tokens, top_k, num_experts, dtype)
            self._configs[cache_key] = config
        return config

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        w13, w2 = layer.w13_weight, layer.w2_weight
        scales = expert_scales(layer)
        _check_shapes(x, topk_weights, topk_ids, w13, w2, scales[0] if scales else None)
        num_tokens, top_k = topk_ids.shape
        out = x.new_empty(x.shape)  # contiguous, whatever x's strides
        if num_tokens == 0:
            return out
        ws = self._workspace(Sizes(self.chunk_tokens, top_k, w13.shape[0], x.shape[1], w2.shape[2]), x.dtype)
        weights = topk_weights.to(torch.float32)
        for start in range(0, num_tokens, self.chunk_tokens):
            end = min(start + self.chunk_tokens, num_tokens)
            self._apply_chunk(ws, x[start:end], weights[start:end], topk_ids[start:end], w13, w2, out[start:end], scales)
        return out

    def _apply_chunk(self, ws: Workspace, x, weights, ids, w13, w2, out, scales=None) -> None:
        (num_tokens, top_k), (num_experts, hidden, intermediate) = ids.shape, w2.shape
        num_pairs = num_tokens * top_k
        config = self.launch_config(num_tokens, top_k, num_experts, intermediate, hidden, x.dtype)
        if num_tokens == 1 and ids.dtype == torch.int32 and self.one_token_layout:  # no sort (the module docstring)
            sorted_ids, num_post_padded = ws.one_token[config.block_m]
            layout, num_blocks = (sorted_ids, ids.reshape(-1), num_post_padded), top_k
        else:
            layout = (ws.sorted_ids, ws.expert_ids, ws.num_post_padded)
            num_blocks = align.align(ids, num_experts, config.block_m, *layout, ws.chunk_counts)
        h, out_pairs = ws.views(num_pairs, intermediate, hidden)
        if scales is None:
            gemm.gate_up(x, w13, h, *layout, top_k, num_blocks, config.block_m, config.gate_up)
            gemm.down(h, w2, weights.reshape(-1), out_pairs, *layout, num_pairs, num_blocks, config.block_m, config.down)
        else:
            _fp8_gemms(config, scales, x, w13, w2, h, weights.reshape(-1), out_pairs, layout, top_k, num_blocks)
        torch.sum(out_pairs.view(num_tokens, top_k, hidden), dim=1, out=out)


def _fp8_gemms(config: Config, scales, x, w13, w2, h, weights, out_pairs, layout, top_k: int, num_blocks: int) -> None:
    """Steps 2 and 3 on FP8 experts: x and then h quantized (dynamic scales), both GEMMs on FP8."""
    quant, w13_scale, w2_scale = scales
    gate_up, down = config.gate_up, config.down
    if quant.block is not None:  # one K step per scale column
        gate_up = dataclasses.replace(gate_up, block_k=quant.block[1])
        down = dataclasses.replace(down, block_k=quant.block[1])
    xq, x_scale = quantize_activations(x, quant)
    gemm.gate_up(xq, w13, h, *layout, top_k, num_blocks, config.block_m, gate_up,
                 gemm.Scales(x_scale, w13_scale, quant.block))
    hq, h_scale = quantize_activations(h, quant)
    gemm.down(hq, w2, weights, out_pairs, *layout, h.shape[0], num_blocks, config.block_m, down,
              gemm.Scales(h_scale, w2_scale, quant.block))


def _check_shapes(x, topk_weights, topk_ids, w13, w2, quant: ExpertQuant | None = None) -> None:
    """One-line errors for inputs that do not fit together (shapes only: no device work)."""
    if x.dim() != 2 or topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"moe backend triton: expected x [T, H], topk_weights and topk_ids [T, k], got x "
                         f"{list(x.shape)}, topk_weights {list(topk_weights.shape)}, topk_ids {list(topk_ids.shape)}")
    num_experts, hidden, intermediate = w2.shape
    if w13.shape != (num_experts, 2 * intermediate, hidden) or x.shape[1] != hidden:
        raise ValueError(f"moe backend triton: expected w13_weight [E, 2I, H] and w2_weight [E, H, I] with H = "
                         f"{x.shape[1]} (x's), got w13_weight {list(w13.shape)}, w2_weight {list(w2.shape)}")
    weight_dtype = x.dtype if quant is None else quant.weight_dtype
    if topk_ids.dtype not in (torch.int32, torch.int64) or w13.dtype != weight_dtype or w2.dtype != weight_dtype:
        raise ValueError(f"moe backend triton: expected int32 topk_ids and w13_weight, w2_weight of dtype {weight_dtype} "
                         f"({'the experts quantization' if quant else 'x'}'s), got topk_ids {topk_ids.dtype}, x {x.dtype}, "
                         f"w13_weight {w13.dtype}, w2_weight {w2.dtype}")
