"""CompiledForward: the model's forward under torch.compile, the plugins' kernels kept opaque.

Attention and LoRA layers route through `torch.ops.backplane.*` while Dynamo traces
(backplane.ops.opaque), so the compiled region holds the model's own math (norms, rotary, MLP,
logits) and one opaque call per layer's attention and LoRA delta. Custom ops declared compile-safe
(torch.library ops of a plugin) stay opaque calls too; the others run as their native code. Planning (the attention backend's
metadata, the LoRA batch info) is done by the caller before each call, outside the region, and the
caller binds the ForwardContext (with the compile-safe op table) around the call.
"""

from __future__ import annotations

from typing import Any

import torch

from backplane.ops.dispatch import CustomOps

# Compiled shapes per forward (graph sizes x modes x graph variants) can pass Dynamo's default of 8;
# past its limit Dynamo would silently run eagerly, which `--enable-torch-compile` must never do.
_RECOMPILE_LIMIT = 256


def _raise_recompile_limits() -> None:
    config = torch._dynamo.config
    config.cache_size_limit = max(config.cache_size_limit, _RECOMPILE_LIMIT)
    config.accumulated_cache_size_limit = max(config.accumulated_cache_size_limit, _RECOMPILE_LIMIT)
    if hasattr(config, "fail_on_recompile_limit_hit"):
        config.fail_on_recompile_limit_hit = True


class CompiledForward:
    """Callable like the model: batch -> ModelOutput, through one torch.compile of the model.

    The caller binds the forward's ForwardContext with `ops=compile_ops(model_ops)` before calling:
    custom ops whose implementation declared `compile_safe` (torch.library ops, opaque to Inductor)
    stay, the others become native so Inductor fuses them. Nothing is swapped on the model.
    dynamic: passed to torch.compile (False for CUDA graphs, one compile per captured shape; None
    elsewhere).
    """

    def __init__(self, model: torch.nn.Module, dynamic: bool | None = False):
        _raise_recompile_limits()
        self.compiled = torch.compile(model, dynamic=dynamic)
        self._eager_ops: CustomOps | None = None
        self._compile_ops: CustomOps | None = None

    def compile_ops(self, ops: CustomOps) -> CustomOps:
        """The table the compiled region runs with, for the eager table `ops` (cached)."""
        if ops is not self._eager_ops:
            self._eager_ops, self._compile_ops = ops, ops.for_compile()
        return self._compile_ops

    def __call__(self, batch: Any) -> Any:
        return self.compiled(batch)


def compiles_batch(args: Any, batch: Any) -> bool:
    """Whether an eager (graph-less) forward of `batch` goes through the compiled model: decode and
    verify batches of at most --torch-compile-max-bs requests, as with graphs."""
    mode = batch.forward_mode
    return (mode.is_decode or mode.value == "target_verify") and batch.batch_size <= args.torch_compile_max_bs
