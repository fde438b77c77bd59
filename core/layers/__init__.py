"""The public model-building API: the layers a model plugin builds its model from.

Every layer takes the model's `ModelContext` (backplane.models) or its `parallel` position, and
reads the forward now running from it (the attention backend, the custom-op table), so one model
object serves eager runs, torch.compile and CUDA-graph replay. docs/plugins.md ("Writing a model
plugin") gives every constructor argument and the shapes of every forward.

- tensor parallelism: `ParallelContext`; `ColumnParallelLinear`, `MergedColumnParallelLinear`,
  `QKVParallelLinear`, `RowParallelLinear`; `VocabParallelEmbedding`, `ParallelLMHead`
- `RMSNorm`, `SiluAndMul`, `GeluAndMul` (GeGLU, exact or tanh), `RotaryEmbedding` (rope scaling: default, linear, llama3, longrope, yarn, dynamic)
- `Attention` (hands q, k, v to the forward's attention backend)
- `LogitsProcessor` (rows that need logits, fp32, the context's `logits_out`, final soft-cap),
  `select_logits_rows`
- `FusedMoE` (router, stacked experts on the model's MoE backend, optional shared expert) and
  `expert_params_mapping` (per-expert checkpoint tensors onto its stacked weights)
"""

from backplane.layers.activation import GeluAndMul, SiluAndMul
from backplane.layers.attention import Attention
from backplane.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from backplane.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from backplane.layers.logits import LogitsProcessor, select_logits_rows
from backplane.layers.moe import FusedMoE, expert_params_mapping
from backplane.layers.norm import RMSNorm
from backplane.layers.parallel import ParallelContext
from backplane.layers.rotary import RotaryEmbedding

__all__ = [
    "Attention", "ColumnParallelLinear", "FusedMoE", "GeluAndMul", "LogitsProcessor", "MergedColumnParallelLinear", "ParallelContext",
    "ParallelLMHead", "QKVParallelLinear", "RMSNorm", "RotaryEmbedding", "RowParallelLinear", "SiluAndMul",
    "VocabParallelEmbedding", "expert_params_mapping", "select_logits_rows",
]
