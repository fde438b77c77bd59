"""Building blocks of the models: tensor-parallel linear layers, embeddings, norms, rotary, attention, logits.

Public for plugins that build draft models: `Attention` (the per-layer attention module),
`RMSNorm` and `VocabParallelEmbedding`.
"""

from backplane.layers.attention import Attention
from backplane.layers.embedding import VocabParallelEmbedding
from backplane.layers.norm import RMSNorm

__all__ = ["Attention", "RMSNorm", "VocabParallelEmbedding"]
