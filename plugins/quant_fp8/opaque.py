"""The FP8 linear as one opaque torch op under `--enable-torch-compile`.

Dynamo does not trace into the CUDA path (launch tables looked up per shape, Triton launches with
meta-parameters, `torch._scaled_mm`); the quantized layer hands its matmul to

    torch.ops.backplane_fp8.linear(x, weight, weight_scale, input_scale, bias, counters, scheme) -> y

instead, a single call in the compiled graph that Inductor fuses around. `scheme` is the key of the
layer's `Fp8Scheme` and launch table (`scheme_key`), a string Dynamo bakes in as a constant. The split-K
tile counters are scratch the kernels leave as they found them (all zero), so the op declares no mutation.
"""

from __future__ import annotations

import torch

from backplane.plugins.quant_fp8.options import BUNDLED, TableSource
from backplane.plugins.quant_fp8.scheme import Fp8Scheme

_SCHEMES: dict[str, tuple[Fp8Scheme, TableSource]] = {}


def scheme_key(scheme: Fp8Scheme, table: TableSource = BUNDLED) -> str:
    """A string naming `scheme` and the launch `table` for the op (registered once; equal pairs share a
    key, so two engines of one process with different tables get different keys)."""
    key = repr(scheme) if table == BUNDLED else f"{scheme!r} {table!r}"
    _SCHEMES.setdefault(key, (scheme, table))
    return key


@torch.library.custom_op("backplane_fp8::linear", mutates_args=())
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None,
               bias: torch.Tensor | None, counters: torch.Tensor | None, scheme: str) -> torch.Tensor:
    """x [M, K] in the model dtype -> [M, N] (cuda.cuda_linear with the scheme and table named by `scheme`)."""
    from backplane.plugins.quant_fp8.cuda import cuda_linear

    found = _SCHEMES.get(scheme)
    if found is None:
        raise RuntimeError(f"backplane_fp8::linear: unknown scheme {scheme!r}; expected a key from scheme_key()")
    return cuda_linear(found[0], x, weight, weight_scale, input_scale, bias, counters, found[1])


@fp8_linear.register_fake
def _fp8_linear_fake(x, weight, weight_scale, input_scale, bias, counters, scheme):
    return x.new_empty(x.shape[0], weight.shape[0])
