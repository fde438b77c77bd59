"""The core's builtin plugin for mixture of experts: registers the torch_native reference backend."""

from backplane.plugin.hookspecs import hookimpl
from backplane.plugin.registry import MoeBackendSpec


def torch_native_backend(ctx=None):
    """The torch_native MoeBackend for `ctx` (a MoeBackendContext; None: it reads nothing of it)."""
    from backplane.moe.torch_native import TorchNativeMoeBackend

    return TorchNativeMoeBackend(ctx)


# The quantization methods whose experts it computes with: any ExpertQuant layout (FP8 weights with
# per-channel or block scales), dequantized expert by expert.
QUANT_METHODS = ("fp8",)

# NOTE: no graphs (the loop's shapes follow the routing, and it counts tokens on the host); compile
# yes: under torch.compile every backend runs eagerly inside the opaque op backplane::moe_experts.
SPEC = MoeBackendSpec(
    name="torch_native", factory=torch_native_backend, supports_compile=True, quant_methods=QUANT_METHODS,
    description="the reference: a loop over experts (gather tokens, gate/up, silu*up, down, weighted sum in fp32)")


@hookimpl
def backplane_register_moe_backends(register):
    register(SPEC)
