"""Opaque custom ops that torch.compile cannot see into: attention and the LoRA delta.

Under `--enable-torch-compile` the model's forward is traced by Dynamo. Plugin kernels (Triton
launches with meta-parameters, FlashInfer's planned wrappers, per-layer lookups) do not trace, so
each layer hands its attention and its LoRA delta to one registered torch op instead:

    torch.ops.backplane.attention(q, k, v, out, handle)   # writes out: [T, H, v_dim]
    torch.ops.backplane.rotary_attention(q, k, v, positions, handle, rotary_handle)  # rotary inside: [T, H * D]
    torch.ops.backplane.lora_delta(x, out, handle)        # adds the LoRA delta into out: [T, N]

The first and the last declare `mutates_args=("out",)`; all have fake implementations that check shapes only, so
Dynamo keeps them as single calls and Inductor fuses everything around them. The real
implementation runs the configured backend eagerly (outside the compiled region): it finds the
layer by `handle` (an int from `register_layer`) and the batch in the ForwardContext bound on the
layer's model (`layer.ctx.forward`), which the model runner enters around the compiled forward.
Nothing per-forward is kept here: the handle table maps handles to live layers only. Planning (`init_forward_metadata`, LoRA `prepare_batch`)
stays outside too, before the call. The KV pool is state behind the attention op: the op writes the
new tokens' K/V there, which orders correctly since every layer's op depends on the previous
layer's output. Inside CUDA-graph capture the op launches its kernels into the captured stream.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch

# NOTE: a registry of live layers (handles are process-unique), not per-forward state.
_LAYERS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_HANDLES = itertools.count()


def register_layer(layer: Any) -> int:
    """A process-unique handle for `layer` (target and draft models may share layer ids)."""
    handle = next(_HANDLES)
    _LAYERS[handle] = layer
    return handle


def bound_batch(layer: Any) -> Any:
    """The batch of the forward bound on `layer`'s model (its ModelContext's ForwardContext)."""
    bound = layer.ctx.forward
    if bound is None or bound.batch is None:
        raise RuntimeError("backplane opaque op called outside a forward: the model runner binds a ForwardContext "
                           "(with its batch) on the model before running the compiled forward")
    return bound.batch


def _layer(handle: int) -> Any:
    layer = _LAYERS.get(handle)
    if layer is None:
        raise RuntimeError(f"backplane opaque op: no live layer with handle {handle}")
    return layer


@torch.library.custom_op("backplane::attention", mutates_args=("out",))
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, handle: int) -> None:
    """q: [T, H, D]; k, v: [T, H_kv, D]; out: [T, H, v_dim], written with the layer's attention."""
    layer = _layer(handle)
    o = layer.ctx.attn_backend.forward(q, k, v, layer.info, bound_batch(layer))
    out.copy_(o.view(out.shape))


@attention.register_fake
def _attention_fake(q, k, v, out, handle) -> None:
    torch._check(out.shape[0] == q.shape[0])
    return None


@torch.library.custom_op("backplane::rotary_attention", mutates_args=())
def rotary_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, handle: int,
                     rotary_handle: int) -> torch.Tensor:
    """q: [T, H * D], k, v: [T, H_kv * D] not yet rotated; positions: [T] -> the layer's attention [T, H * D].

    The layer's eager path, rotary included, for a backend that may take K/V written together with
    rotary (`fuses_rotary_kv_write`): the compiled graph then runs the same `rotary_kv_write` op as an
    uncompiled one instead of Inductor's rotary plus the backend's own K/V write. NOTE: q and k may be
    rotated in place, as in the eager path; the layer passes views nobody reads afterwards.
    """
    layer = _layer(handle)
    o = layer.attend(q, k, v, bound_batch(layer), _layer(rotary_handle), positions)
    if any(o.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for t in (q, k, v)):
        o = o.clone()  # a custom op's output may not alias its inputs
    return o


@rotary_attention.register_fake
def _rotary_attention_fake(q, k, v, positions, handle, rotary_handle) -> torch.Tensor:
    torch._check(positions.shape[0] == q.shape[0])
    return q.new_empty(q.shape)


@torch.library.custom_op("backplane::lora_delta", mutates_args=("out",))
def lora_delta(x: torch.Tensor, out: torch.Tensor, handle: int) -> None:
    """x: [T, in]; out: [T, out_features], the base layer's output; the LoRA delta is added in place."""
    _layer(handle).add_delta(x, out)


@lora_delta.register_fake
def _lora_delta_fake(x, out, handle) -> None:
    torch._check(out.shape[0] == x.shape[0])
    return None


def compiling() -> bool:
    """True while Dynamo traces: layers then route through the opaque ops."""
    return torch.compiler.is_compiling()
