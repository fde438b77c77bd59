"""Linear layers split over tensor-parallel ranks, with loaders that take the full checkpoint tensor.

Every layer is a plain nn.Module with `weight` (and optional `bias`) parameters whose forward is
`F.linear(x, weight, bias)`; LoRA wraps them by replacing the module with a wrapper that holds
this one as its base layer. Fused layers keep their local split in `output_sizes`.
`weight_loader(param, loaded_weight, shard_id=None)` is also attached to each parameter.

Quantized: `set_quant_method(method)` (backplane.contracts.QuantMethod) hands the layer to a method,
which replaces `weight` with its own parameters (weight, scales) and computes the forward. The
loaders read each parameter's `ShardLayout` (`param.shard_layout`; an unquantized weight or bias has
the default one), so scales shard with their weights: per-channel scales with the output rows,
block scales by blocks, per-tensor scales of a fused layer one per part.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backplane.contracts.quant import LinearPartition, QuantMethod, layout_of
from backplane.layers.parallel import ParallelContext, divide

_SINGLE = ParallelContext()


def copy_checked(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    """param.copy_(loaded) after checking shapes; `what` names the weight in the error."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"{what}: expected shape {tuple(param.shape)}, got {tuple(loaded.shape)}")
    with torch.no_grad():
        param.copy_(loaded)


def _load_part(param, loaded: torch.Tensor, what: str, index: int, dest: int, size: int, source: int) -> None:
    """Copy rows [source, source + size) of the full `loaded` into rows [dest, dest + size) of `param`,
    rows counted in weight rows along the layout's output dim (divided by its block); a per-part
    parameter (a per-tensor scale) takes `loaded` at element `index`."""
    layout = layout_of(param)
    if layout.per_partition:
        if loaded.numel() != 1:
            raise ValueError(f"{what}: expected a per-tensor scale (one value), got shape {tuple(loaded.shape)}")
        with torch.no_grad():
            param[index].copy_(loaded.reshape(()))
        return
    if layout.output_dim is None:
        return copy_checked(param, loaded, what)
    dim, block = layout.output_dim, layout.output_block
    for rows in (dest, size, source):
        if rows % block:
            raise ValueError(f"{what}: rows {dest}+{size} (source row {source}) are not whole blocks of {block}; "
                             "expected every fused part and tensor-parallel shard to be a multiple of the block size")
    shard = loaded.narrow(dim, source // block, -(-size // block))
    copy_checked(param.narrow(dim, dest // block, -(-size // block)), shard, what)


def _split_input(param, loaded: torch.Tensor, rank: int, what: str) -> torch.Tensor:
    """This rank's columns of `loaded` along the layout's input dim (row-parallel), by blocks."""
    dim = layout_of(param).input_dim
    if dim is None:
        return loaded
    n = param.shape[dim]
    if loaded.shape[dim] < (rank + 1) * n:
        raise ValueError(f"{what}: expected at least {(rank + 1) * n} entries along dim {dim}, got {tuple(loaded.shape)}")
    return loaded.narrow(dim, rank * n, n)


class _LinearBase(nn.Module):
    """Holds weight [out_local, in_local] and optional bias [out_local] in `params_dtype`.

    quant_method: None (the plain `F.linear` path), or the QuantMethod set by `set_quant_method`.
    """

    def __init__(self, in_local: int, out_local: int, bias: bool, parallel: ParallelContext, params_dtype):
        super().__init__()
        self.parallel = parallel
        self.input_size_per_partition = in_local
        self.output_size_per_partition = out_local
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(out_local, in_local, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_local, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        self.params_dtype = dtype
        self.quant_method: QuantMethod | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, self.bias)
        return F.linear(x, self.weight, self.bias)

    def partition(self) -> LinearPartition:
        """This layer's sizes and position, as a QuantMethod sees them."""
        row = isinstance(self, RowParallelLinear)
        parts = tuple(getattr(self, "output_sizes", None) or (self.output_size_per_partition,))
        return LinearPartition(
            input_size=self.input_size, output_size=self.output_size,
            input_size_per_partition=self.input_size_per_partition, output_partition_sizes=parts,
            parallel="row" if row else "column", tp_rank=self.parallel.tp_rank, tp_size=self.parallel.tp_size,
            params_dtype=self.params_dtype, device=self.weight.device)

    def set_quant_method(self, method: QuantMethod) -> None:
        """Hand the layer to `method`: the plain weight goes, the method registers its own parameters
        (each gets this layer's `weight_loader`), and the forward becomes `method.apply`."""
        partition = self.partition()
        del self.weight
        self.quant_method = method
        method.create_weights(self, partition)
        for name, param in self.named_parameters(recurse=False):
            if name != "bias" and not hasattr(param, "weight_loader"):
                param.weight_loader = self.weight_loader
        if not hasattr(self, "weight"):
            raise AssertionError(f"{type(method).__name__}.create_weights registered no 'weight' parameter")

    def process_weights_after_loading(self) -> None:
        """The quant method's once-after-loading step (nothing for an unquantized layer)."""
        if self.quant_method is not None:
            self.quant_method.process_weights_after_loading(self)

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        raise NotImplementedError


class ColumnParallelLinear(_LinearBase):
    """y = x W^T + b with W's output rows split over ranks; each rank returns its slice of y."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 parallel: ParallelContext = _SINGLE, params_dtype=None):
        out_local = divide(output_size, parallel.tp_size, "output size")
        super().__init__(input_size, out_local, bias, parallel, params_dtype)
        self.input_size, self.output_size = input_size, output_size

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        """loaded_weight: the full [output_size, input_size] weight or [output_size] bias (or a scale,
        split by its ShardLayout)."""
        layout = layout_of(param)
        what = f"{type(self).__name__} rank {self.parallel.tp_rank}"
        if layout.output_dim is None or layout.per_partition:
            return _load_part(param, loaded_weight, what, 0, 0, 0, 0)
        n = param.shape[layout.output_dim]
        shard = loaded_weight.narrow(layout.output_dim, self.parallel.tp_rank * n, n)
        copy_checked(param, shard, what)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused along the output dim (gate and up of an MLP).

    output_sizes: the local size of each part, in order ([gate, up]).
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 parallel: ParallelContext = _SINGLE, params_dtype=None):
        super().__init__(input_size, sum(output_sizes), bias, parallel, params_dtype)
        self.output_sizes = [divide(s, parallel.tp_size, "merged output size") for s in output_sizes]

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        """shard_id: the part index (0 = gate, 1 = up); loaded_weight: that part's full tensor."""
        if shard_id is None:
            if layout_of(param).per_partition:  # one scale for the fused tensor: every part has it
                for index in range(len(self.output_sizes)):
                    _load_part(param, loaded_weight, type(self).__name__, index, 0, 0, 0)
                return
            return super().weight_loader(param, loaded_weight)
        size = self.output_sizes[shard_id]
        offset = sum(self.output_sizes[:shard_id])
        _load_part(param, loaded_weight, f"{type(self).__name__} part {shard_id}", shard_id, offset, size,
                   self.parallel.tp_rank * size)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projections; heads split over ranks, KV heads replicated when fewer than ranks.

    output_sizes: local [q, k, v] sizes = [num_heads * head_dim, num_kv_heads * head_dim (twice)].
    """

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False, parallel: ParallelContext = _SINGLE, params_dtype=None):
        tp = parallel.tp_size
        num_heads = divide(total_num_heads, tp, "number of attention heads")
        if total_num_kv_heads >= tp:
            num_kv_heads, kv_replicas = divide(total_num_kv_heads, tp, "number of KV heads"), 1
        else:
            num_kv_heads, kv_replicas = 1, divide(tp, total_num_kv_heads, "tp_size over KV heads")
        local = (num_heads + 2 * num_kv_heads) * head_dim
        super().__init__(hidden_size, local * tp, bias, parallel, params_dtype)
        self.num_heads, self.num_kv_heads, self.kv_replicas = num_heads, num_kv_heads, kv_replicas
        self.head_dim = head_dim
        self.output_size = (total_num_heads + 2 * total_num_kv_heads) * head_dim
        self.output_sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]

    def _source_offset(self, shard_id: str) -> int:
        rank = self.parallel.tp_rank
        if shard_id == "q":
            return rank * self.output_sizes[0]
        return (rank // self.kv_replicas) * self.output_sizes[1]

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        """shard_id "q", "k" or "v" with that projection's full tensor, or None for a fused qkv tensor."""
        layout = layout_of(param)
        if shard_id is None:
            if layout.per_partition or layout.output_dim is None:  # one scale for the fused tensor
                for sid in "qkv":
                    self.weight_loader(param, loaded_weight, sid)
                return
            total_q = self.output_sizes[0] * self.parallel.tp_size
            total_kv = self.num_kv_heads * self.head_dim * self.parallel.tp_size // self.kv_replicas
            block = layout.output_block
            sizes = [-(-total_q // block), -(-total_kv // block), -(-total_kv // block)]
            for sid, part in zip("qkv", loaded_weight.split(sizes, dim=layout.output_dim)):
                self.weight_loader(param, part, sid)
            return
        index = "qkv".index(shard_id)
        size, offset = self.output_sizes[index], sum(self.output_sizes[:index])
        _load_part(param, loaded_weight, f"QKVParallelLinear shard {shard_id!r}", index, offset, size,
                   self._source_offset(shard_id))


class RowParallelLinear(_LinearBase):
    """y = x W^T + b with W's input columns split over ranks; partial sums are all-reduced.

    x: [..., input_size / tp_size] (the local slice); returns the full [..., output_size].
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 parallel: ParallelContext = _SINGLE, params_dtype=None, reduce_results: bool = True):
        in_local = divide(input_size, parallel.tp_size, "input size")
        super().__init__(in_local, output_size, bias, parallel, params_dtype)
        self.input_size, self.output_size = input_size, output_size
        self.reduce_results = reduce_results

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            if self.quant_method is None:
                return F.linear(x, self.weight, self.bias)
            return self.quant_method.apply(self, x, self.bias)
        # NOTE: the bias is added once, by rank 0, so the all-reduce does not multiply it.
        bias = self.bias if self.parallel.tp_rank == 0 else None
        if self.quant_method is not None:
            y = self.quant_method.apply(self, x, bias)
        else:
            y = F.linear(x, self.weight, bias)
        return self.parallel.all_reduce(y) if self.reduce_results else y

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        """loaded_weight: the full [output_size, input_size] weight or the (unsplit) [output_size] bias
        (or a scale: block scales split along the input by blocks, the others whole)."""
        what = f"RowParallelLinear rank {self.parallel.tp_rank}"
        loaded_weight = _split_input(param, loaded_weight, self.parallel.tp_rank, what)
        if layout_of(param).per_partition:
            return _load_part(param, loaded_weight, what, 0, 0, 0, 0)
        copy_checked(param, loaded_weight, what)
