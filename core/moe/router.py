"""The router of a mixture-of-experts layer: which k experts each token goes to, with what weight.

The core owns it (a MoE backend receives its result): softmax over the E router logits in fp32,
the k largest probabilities (ties to the lower expert id, as torch.topk), and, when the model asks,
renormalisation of those k to sum to 1 (Mixtral always; Qwen2-MoE and Qwen3-MoE by
`norm_topk_prob`). The arithmetic is the native `moe_route` custom op (backplane.ops.native): plain
torch ops of fixed shapes, capturable in CUDA graphs and traceable by torch.compile. `route` checks
its arguments, then runs that native op; FusedMoE checks top_k once when built and calls the
`moe_route` op resolved for the run (`ctx.ops.moe_route`, which a plugin may implement).
"""

from __future__ import annotations

import torch

from backplane.ops import native

SCORINGS = ("softmax",)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          scoring: str = "softmax") -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [T, E] (any float dtype) -> (topk_weights [T, k] fp32, topk_ids [T, k] int32).

    topk_weights[t] are the k largest of softmax(router_logits[t]) computed in fp32, in decreasing
    order, divided by their sum when `renormalize`; topk_ids[t] are their experts.
    """
    if scoring not in SCORINGS:
        raise ValueError(f"route: scoring {scoring!r} is not supported; expected one of {', '.join(SCORINGS)}")
    if router_logits.dim() != 2:
        raise ValueError(f"route: router_logits must be [num_tokens, num_experts], got shape "
                         f"{tuple(router_logits.shape)}")
    num_experts = router_logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"route: top_k {top_k} out of range; expected 1 <= top_k <= num_experts ({num_experts})")
    return native.moe_route(router_logits, top_k, renormalize)
