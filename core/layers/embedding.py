"""Token embedding and LM head with the vocabulary split over tensor-parallel ranks.

Each rank holds rows [vocab_start, vocab_start + num_embeddings_per_partition) of the (padded)
vocabulary; rows past the real vocabulary are zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backplane.layers.linear import copy_checked
from backplane.layers.parallel import ParallelContext

_SINGLE = ParallelContext()


class VocabParallelEmbedding(nn.Module):
    """weight: [num_embeddings_per_partition, embedding_dim]; forward(ids: [T]) -> [T, embedding_dim]."""

    def __init__(self, num_embeddings: int, embedding_dim: int, parallel: ParallelContext = _SINGLE,
                 params_dtype=None):
        super().__init__()
        self.parallel = parallel
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_per_partition = -(-num_embeddings // parallel.tp_size)
        self.vocab_start = parallel.tp_rank * self.num_embeddings_per_partition
        shape = (self.num_embeddings_per_partition, embedding_dim)
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        """loaded_weight: the full [num_embeddings, embedding_dim] table; this rank keeps its rows."""
        full = (self.num_embeddings, self.embedding_dim)
        if tuple(loaded_weight.shape) != full:
            raise ValueError(f"{type(self).__name__}: expected shape {full}, got {tuple(loaded_weight.shape)}")
        end = min(self.vocab_start + param.shape[0], self.num_embeddings)
        rows = loaded_weight[self.vocab_start : end]
        with torch.no_grad():
            param.zero_()
        copy_checked(param[: rows.shape[0]], rows, type(self).__name__)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings_per_partition)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[:, None], 0)
        return self.parallel.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection; used through LogitsProcessor (its forward is not called)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead has no forward; LogitsProcessor reads its weight")
