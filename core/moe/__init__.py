"""Mixture of experts in the core: the router, the call into the model's MoE backend, and the
torch_native reference backend (the contract: backplane.contracts.moe)."""

from backplane.moe.opaque import moe_experts, register_moe_layer
from backplane.moe.router import route
from backplane.moe.torch_native import TorchNativeMoeBackend, moe_reference

__all__ = ["TorchNativeMoeBackend", "moe_experts", "moe_reference", "register_moe_layer", "route"]
