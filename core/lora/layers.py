"""LoRA wrappers of the model's linear layers: the base layer's own forward, then the LoRA delta.

`wrap_model` replaces every q/k/v, o, gate/up and down projection module with a wrapper that holds
the original module as `base_layer` (its forward is called, never copied) and one stacked weight
buffer per projection, allocated once for every slot at the padded rank R_max (the layout of
core/contracts/lora.py):

  lora_a: [num_slots, num_slices * R_max, in_features]
  lora_b: [num_slots, out_features, R_max]

Slot 0 stays zero (base only). `load_slot` copies an adapter's A/B in place, zero-padded to R_max.
With a backend that folds the shrink into the base GEMM (`LoraBackend.folds_shrink`), lora_a and the
base weight are two views of one buffer [W; A] (`LoraLinear._fold`), so decode-sized passes run one
GEMM and one expand launch per projection (not for row-parallel layers on several ranks, whose
shrink must be all-reduced before the expand).

A quantized base layer (`base_layer.quant_method` set, e.g. FP8 weights): the adapter weights and the
LoRA arithmetic take the layer's activation dtype (`base_layer.params_dtype`, the model dtype), never
the quantized weight's; the base output is the quant method's `apply` (the base layer's forward), and
the delta is added to it as for a plain layer. The folded path is declined for such a layer: a
high-precision copy of W to stack A under would double the weight memory of an FP8 model and give
back the FP8 GEMM's speed, so its decode-sized passes run the base layer's own (quantized) GEMM, then
the backend's unfolded `apply_lora` (the fused shrink-and-expand kernel of triton). The decline is
logged and shown in the LoRA summary (`fold_declined`, `LoraManager.summary()["decode_path"]`).

Every wrapper of one model reads the current batch from one shared `LoraRuntime`: its
`batch_info` is the "lora" binding of the ForwardContext bound on the model (None between
forwards and for a base-only forward: the pass runs without LoRA).

Tensor parallelism: a column-parallel layer (q/k/v, gate/up) keeps A whole and takes its rank's
rows of B (for k/v the rows of its KV heads, shared by `kv_replicas` ranks); a row-parallel layer
(o, down) takes its rank's columns of A and all-reduces the shrink result before the expand, so
every rank adds the same full delta to the all-reduced base output. `shard_pair` does the slicing;
adapters are validated against `full_projection_shape`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from backplane.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from backplane.contracts.forward_context import ForwardSlot
from backplane.contracts.lora import LoraBackend
from backplane.contracts.lora_batch import LoraBatchInfo
from backplane.ops import opaque

# The Hugging Face projections each fused module of the Llama family holds, in output order.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)$")


@dataclass
class LoraRuntime:
    """What every LoRA layer of one model shares: the backend, and the model's forward slot, whose
    bound ForwardContext carries the forward's LoRA binding."""

    backend: LoraBackend
    forward_slot: ForwardSlot

    @property
    def batch_info(self) -> LoraBatchInfo | None:
        """The running forward's LoraBatchInfo; None between forwards and for a base-only forward."""
        bound = self.forward_slot.active
        return bound.binding("lora") if bound is not None else None


class LoraLinear(nn.Module):
    """A linear layer plus LoRA: y = base_layer(x) + scaling[slot] * (x A[slot]^T) B[slot]^T.

    projections: the Hugging Face names of the output slices (("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj") or one name); slice_sizes: their output widths.
    """

    def __init__(self, base_layer: nn.Module, runtime: LoraRuntime, layer_id: int,
                 projections: tuple[str, ...], slice_sizes: list[int], num_slots: int, max_rank: int):
        super().__init__()
        self.base_layer = base_layer
        self.runtime = runtime
        self.layer_id = layer_id
        self.projections = projections
        self.max_rank = max_rank
        self.offsets = tuple(sum(slice_sizes[:j]) for j in range(len(slice_sizes) + 1))
        dtype, device = activation_dtype(base_layer), base_layer.weight.device
        in_features = input_features(base_layer)
        # NOTE: plain attributes, not buffers: they are not checkpoint weights.
        self.lora_b = torch.zeros(num_slots, self.offsets[-1], max_rank, dtype=dtype, device=device)
        self.w_ext = self.bias_ext = None
        #: why the folded path is not taken for this layer though the backend folds (None: folded, or not asked)
        self.fold_declined: str | None = None
        a_shape = (num_slots, len(projections) * max_rank, in_features)
        if runtime.backend.folds_shrink and not self._sharded_input:
            self.fold_declined = fold_refusal(base_layer)
            if self.fold_declined is None:
                self._fold(a_shape)
        if self.w_ext is None:
            self.lora_a = torch.zeros(a_shape, dtype=dtype, device=device)
        self.handle = opaque.register_layer(self)  # for torch.ops.backplane.lora_delta under torch.compile

    def _fold(self, a_shape: tuple[int, int, int]) -> None:
        """One buffer w_ext = [W; A of every slot]: the base weight becomes its first rows (a view, so
        the base layer and weight loading are unchanged) and lora_a the rest, so a folded pass shrinks
        inside the base GEMM (LoraBackend.expand_folded). The bias, if any, gets zeros for those rows."""
        base = self.base_layer
        weight = base.weight
        num_base = weight.shape[0]
        extra = a_shape[0] * a_shape[1]
        self.w_ext = torch.zeros(num_base + extra, weight.shape[1], dtype=weight.dtype, device=weight.device)
        self.w_ext[:num_base].copy_(weight.data)
        weight.data = self.w_ext[:num_base]
        self.lora_a = self.w_ext[num_base:].view(a_shape)
        if base.bias is not None:
            self.bias_ext = torch.zeros(num_base + extra, dtype=base.bias.dtype, device=base.bias.device)
            self.bias_ext[:num_base].copy_(base.bias.data)
            base.bias.data = self.bias_ext[:num_base]

    @property
    def num_slices(self) -> int:
        return len(self.projections)

    @property
    def output_sizes(self) -> list[int]:
        return self.base_layer.output_sizes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in_features] -> out: [T, out_features]
        runtime = self.runtime
        if (self.w_ext is not None and runtime.batch_info is not None and not opaque.compiling()
                and runtime.backend.folds(x.shape[0])):
            return self.forward_folded(x)
        out = self.base_layer(x)
        if runtime.batch_info is None:
            return out
        if opaque.compiling():  # one opaque op: Dynamo never traces the LoRA backend's kernels
            torch.ops.backplane.lora_delta(x, out, self.handle)
            return out
        self.add_delta(x, out)
        return out

    def forward_folded(self, x: torch.Tensor) -> torch.Tensor:
        """The base GEMM over [W; A] (every slot's shrink comes with it), then the backend's expand
        writes base + delta into a fresh output: one GEMM and one LoRA launch per projection group."""
        y = torch.nn.functional.linear(x, self.w_ext, self.bias_ext)
        num_base = self.lora_b.shape[1]
        out = torch.empty(x.shape[0], num_base, dtype=y.dtype, device=y.device)
        return self.runtime.backend.expand_folded(y, num_base, self.lora_b, self.offsets, out)

    def add_delta(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """out += this batch's LoRA delta of x, per request's adapter (eagerly, via the backend)."""
        backend = self.runtime.backend
        if not self._sharded_input:  # shrink and expand in one call (one kernel where fused)
            return backend.apply_lora(x, self.lora_a, self.lora_b, self.offsets, out)
        shrunk = backend.lora_a(x, self.lora_a, self.num_slices)  # [T, num_slices * R_max]
        shrunk = self.base_layer.parallel.all_reduce(shrunk)  # partial sums over the input shards
        self.expand(backend, shrunk, out)

    @property
    def _sharded_input(self) -> bool:
        """A row-parallel layer on more than one rank: its shrink is all-reduced before the expand."""
        base = self.base_layer
        return isinstance(base, RowParallelLinear) and base.parallel.tp_size > 1

    def expand(self, backend: LoraBackend, shrunk: torch.Tensor, out: torch.Tensor) -> None:
        backend.lora_b(shrunk, self.lora_b, out)

    @torch.no_grad()
    def load_slot(self, slot: int, pairs: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Write one adapter into `slot`: pairs[j] = (A [r, in], B [out_j, r]) for slice j, or None
        when the adapter does not target that projection (the slice stays zero)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for j, pair in enumerate(pairs):
            if pair is None:
                continue
            a, b = shard_pair(self, j, *pair)
            rank = a.shape[0]
            self.lora_a[slot, j * self.max_rank : j * self.max_rank + rank].copy_(a, non_blocking=True)
            self.lora_b[slot, self.offsets[j] : self.offsets[j + 1], :rank].copy_(b, non_blocking=True)


def quant_method_of(base: nn.Module):
    """The base layer's QuantMethod, or None for a plain (high-precision) linear."""
    return getattr(base, "quant_method", None)


def activation_dtype(base: nn.Module) -> torch.dtype:
    """The dtype the layer's activations (and so the adapter weights) have: a quantized layer's
    params_dtype (the model dtype), else its weight's dtype."""
    if quant_method_of(base) is not None:
        return base.params_dtype
    return base.weight.dtype


def input_features(base: nn.Module) -> int:
    """This rank's input columns (a quantized weight may be stored packed; the layer's sizes are not)."""
    local = getattr(base, "input_size_per_partition", None)
    return int(local) if local is not None else base.weight.shape[1]


def output_features(base: nn.Module) -> int:
    local = getattr(base, "output_size_per_partition", None)
    return int(local) if local is not None else base.weight.shape[0]


def fold_refusal(base: nn.Module) -> str | None:
    """Why the shrink cannot be folded into `base`'s GEMM (None: it can): a quantized weight has no
    high-precision rows to stack A under (see the module docstring)."""
    method = quant_method_of(base)
    if method is None:
        return None
    return (f"the base weight is quantized ({type(method).__name__}, {base.weight.dtype}): the base runs its "
            "quantized GEMM, then the unfolded LoRA kernels")


class QKVLoraLinear(LoraLinear):
    """q, k, v fused: one stacked shrink, then the fused expand into the three output slices."""

    def expand(self, backend: LoraBackend, shrunk: torch.Tensor, out: torch.Tensor) -> None:
        backend.qkv_lora_b(shrunk, self.lora_b, self.offsets, out)


class GateUpLoraLinear(LoraLinear):
    """gate and up fused: one stacked shrink, then the fused expand into both halves."""

    def expand(self, backend: LoraBackend, shrunk: torch.Tensor, out: torch.Tensor) -> None:
        backend.gate_up_lora_b(shrunk, self.lora_b, out)


def _source_shard(layer: LoraLinear, slice_index: int) -> int:
    """Which shard of the full output slice this rank holds (k/v heads may be shared by ranks)."""
    base, rank = layer.base_layer, layer.base_layer.parallel.tp_rank
    if isinstance(base, QKVParallelLinear) and slice_index > 0:
        return rank // base.kv_replicas
    return rank


def full_projection_shape(layer: LoraLinear, slice_index: int) -> tuple[int, int]:
    """(in_features, out_features) of projection `slice_index` before the tensor-parallel split."""
    base = layer.base_layer
    width = layer.offsets[slice_index + 1] - layer.offsets[slice_index]
    in_features = layer.lora_a.shape[2]
    parallel = getattr(base, "parallel", None)
    tp = parallel.tp_size if parallel is not None else 1
    if isinstance(base, RowParallelLinear):
        return in_features * tp, width
    if isinstance(base, QKVParallelLinear) and slice_index > 0:
        return in_features, width * tp // base.kv_replicas
    return in_features, width * tp


def shard_pair(layer: LoraLinear, slice_index: int, a: torch.Tensor, b: torch.Tensor):
    """This rank's part of (A [r, in], B [out, r]) for slice `slice_index` (see the module docstring)."""
    base = layer.base_layer
    parallel = getattr(base, "parallel", None)
    if parallel is None or parallel.tp_size == 1:
        return a, b
    if isinstance(base, RowParallelLinear):
        n = layer.lora_a.shape[2]
        return a.narrow(1, parallel.tp_rank * n, n), b
    width = layer.offsets[slice_index + 1] - layer.offsets[slice_index]
    return a, b.narrow(0, _source_shard(layer, slice_index) * width, width)


def _wrapper_for(base: nn.Module, attr: str):
    """(wrapper class, projection names, slice sizes) for a projection module, or None."""
    if isinstance(base, QKVParallelLinear) and attr in FUSED:
        return QKVLoraLinear, FUSED[attr], list(base.output_sizes)
    if isinstance(base, ColumnParallelLinear) and attr in FUSED:
        return GateUpLoraLinear, FUSED[attr], list(base.output_sizes)
    if isinstance(base, (ColumnParallelLinear, RowParallelLinear)) and attr not in FUSED:
        return LoraLinear, (attr,), [output_features(base)]
    return None


def wrap_model(model: nn.Module, runtime: LoraRuntime, num_slots: int, max_rank: int) -> list[LoraLinear]:
    """Replace every decoder-layer projection of `model` by its LoRA wrapper; returns the wrappers."""
    wrappers = []
    for name, module in list(model.named_modules()):
        match = _LAYER.search(name)
        found = _wrapper_for(module, match.group(2)) if match else None
        if found is None:
            continue
        cls, projections, sizes = found
        wrapper = cls(module, runtime, int(match.group(1)), projections, sizes, num_slots, max_rank)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, wrapper)
        wrappers.append(wrapper)
    if not wrappers:
        raise ValueError(
            f"LoRA: found no q/k/v, o, gate/up or down projection in {type(model).__name__}; "
            "expected decoder layers named like model.layers.N.self_attn.qkv_proj"
        )
    return wrappers
