"""Linear layers split over tensor-parallel ranks, with loaders that take the full checkpoint tensor.

Every layer is a plain nn.Module with `weight` (and optional `bias`) parameters whose forward is
`F.linear(x, weight, bias)`; LoRA wraps them by replacing the module with a wrapper that holds
this one as its base layer. Fused layers keep their local split in `output_sizes`.
`weight_loader(param, loaded_weight, shard_id=None)` is also attached to each parameter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backplane.layers.parallel import ParallelContext, divide

_SINGLE = ParallelContext()


def copy_checked(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    """param.copy_(loaded) after checking shapes; `what` names the weight in the error."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"{what}: expected shape {tuple(param.shape)}, got {tuple(loaded.shape)}")
    with torch.no_grad():
        param.copy_(loaded)


class _LinearBase(nn.Module):
    """Holds weight [out_local, in_local] and optional bias [out_local] in `params_dtype`."""

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

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
        """loaded_weight: the full [output_size, input_size] weight or [output_size] bias."""
        n = param.shape[0]
        shard = loaded_weight.narrow(0, self.parallel.tp_rank * n, n)
        copy_checked(param, shard, f"{type(self).__name__} rank {self.parallel.tp_rank}")


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
            return super().weight_loader(param, loaded_weight)
        size = self.output_sizes[shard_id]
        offset = sum(self.output_sizes[:shard_id])
        shard = loaded_weight.narrow(0, self.parallel.tp_rank * size, size)
        copy_checked(param.narrow(0, offset, size), shard, f"{type(self).__name__} part {shard_id}")


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
        if shard_id is None:
            total_q = self.output_sizes[0] * self.parallel.tp_size
            total_kv = (loaded_weight.shape[0] - total_q) // 2
            for sid, part in zip("qkv", loaded_weight.split([total_q, total_kv, total_kv], dim=0)):
                self.weight_loader(param, part, sid)
            return
        index = "qkv".index(shard_id)
        size, offset = self.output_sizes[index], sum(self.output_sizes[:index])
        shard = loaded_weight.narrow(0, self._source_offset(shard_id), size)
        copy_checked(param.narrow(0, offset, size), shard, f"QKVParallelLinear shard {shard_id!r}")


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
            return F.linear(x, self.weight, self.bias)
        # NOTE: the bias is added once, by rank 0, so the all-reduce does not multiply it.
        y = F.linear(x, self.weight, self.bias if self.parallel.tp_rank == 0 else None)
        return self.parallel.all_reduce(y) if self.reduce_results else y

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        """loaded_weight: the full [output_size, input_size] weight or the (unsplit) [output_size] bias."""
        if param.dim() == 2:
            n = param.shape[1]
            loaded_weight = loaded_weight.narrow(1, self.parallel.tp_rank * n, n)
        copy_checked(param, loaded_weight, f"RowParallelLinear rank {self.parallel.tp_rank}")
