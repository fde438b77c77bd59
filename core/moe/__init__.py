"""Mixture of experts in the core: the router, the call into the model's MoE backend, the
torch_native reference backend, and the arithmetic of quantized experts every backend shares
(the contract: backplane.contracts.moe)."""

from backplane.moe.opaque import moe_experts, register_moe_layer
from backplane.moe.quant import dequantize_expert, expert_scales, quantize_activations
from backplane.moe.router import route
from backplane.moe.torch_native import TorchNativeMoeBackend, moe_reference

__all__ = ["TorchNativeMoeBackend", "dequantize_expert", "expert_scales", "moe_experts", "moe_reference",
           "quantize_activations", "register_moe_layer", "route"]
