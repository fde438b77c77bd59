"""The MoE experts as an opaque custom op for torch.compile, and the call every MoE layer makes.

    torch.ops.backplane.moe_experts(x, topk_weights, topk_ids, handle) -> [T, H]

Under `--enable-torch-compile` Dynamo keeps this one call in the graph (its fake implementation
only gives the output's shape) and Inductor fuses the router and the shared expert around it; the
real implementation finds the layer by `handle` (from `register_moe_layer`, in the same handle
table as the attention and LoRA ops) and runs the model's MoE backend eagerly. Outside a trace
`moe_experts` calls the backend directly.
"""

from __future__ import annotations

import torch

from backplane.ops import opaque


def register_moe_layer(layer: torch.nn.Module) -> int:
    """A process-unique handle for a MoE layer (keep it as `layer.handle`); the table holds it weakly."""
    return opaque.register_layer(layer)


@torch.library.custom_op("backplane::moe_experts", mutates_args=())
def moe_experts_op(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, handle: int) -> torch.Tensor:
    """x: [T, H]; topk_weights: [T, k] fp32; topk_ids: [T, k] int32 -> the layer's expert sum [T, H]."""
    layer = opaque._layer(handle)
    out = layer.ctx.moe_backend.apply(layer, x, topk_weights, topk_ids)
    if out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        out = out.clone()  # a custom op's output may not alias its inputs
    return out


@moe_experts_op.register_fake
def _moe_experts_fake(x, topk_weights, topk_ids, handle) -> torch.Tensor:
    torch._check(topk_ids.shape[0] == x.shape[0])
    return torch.empty_like(x)


def moe_experts(layer: torch.nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
    """The weighted sum of each token's k experts of `layer` ([T, H], x's dtype; this rank's partial
    sum under tensor parallelism): `layer.ctx.moe_backend.apply(...)`, through the opaque op
    `torch.ops.backplane.moe_experts` while torch.compile traces (`layer.handle` from
    `register_moe_layer`).

    layer: has `w13_weight` [E, 2 * I, H], `w2_weight` [E, H, I], `moe_info` and `ctx.moe_backend`.
    topk_weights / topk_ids: as `backplane.moe.route` returns them ([T, k], fp32 / int32).
    """
    if topk_weights.dtype != torch.float32 or topk_ids.dtype != torch.int32:
        raise ValueError(f"moe_experts: expected topk_weights float32 and topk_ids int32 (as backplane.moe.route "
                         f"returns), got {topk_weights.dtype} and {topk_ids.dtype}")
    if opaque.compiling():
        return torch.ops.backplane.moe_experts(x, topk_weights, topk_ids, layer.handle)
    return layer.ctx.moe_backend.apply(layer, x, topk_weights, topk_ids)
