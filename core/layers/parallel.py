"""Tensor-parallel context shared by the layers: which rank this is and how to combine results."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ParallelContext:
    """tp_rank of tp_size ranks.

    group: the process group of the tensor collectives (None: the default group; NCCL on GPU).
    cpu_group: a gloo group over the same ranks for host-side agreement (barriers, pool sizes).
    """

    tp_rank: int = 0
    tp_size: int = 1
    group: Any = None
    cpu_group: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank: expected 0 <= tp_rank < tp_size={self.tp_size}, got {self.tp_rank}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks (in place); a no-op on one rank."""
        if self.tp_size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dim (rank order); a no-op on one rank."""
        if self.tp_size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def barrier(self) -> None:
        """Wait until every rank reaches this point (on the host group); a no-op on one rank."""
        if self.tp_size > 1:
            import torch.distributed as dist

            dist.barrier(group=self.cpu_group)

    def min_over_ranks(self, value: int) -> int:
        """The smallest `value` any rank passes (on the host group); `value` itself on one rank."""
        if self.tp_size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())


def divide(total: int, parts: int, what: str) -> int:
    """total // parts, or a ValueError naming `what` when it does not divide evenly."""
    if total % parts:
        raise ValueError(f"{what}: expected a multiple of tp_size={parts}, got {total}")
    return total // parts
