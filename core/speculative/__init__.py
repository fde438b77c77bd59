"""Speculative decoding: the SpecWorker contract and the helpers every algorithm shares.

Public for algorithm plugins: SpecWorker, SpecContext (and TargetRunner, what an algorithm reads
of the target's runner), SpecStats, DraftTree, verify_mask, verify_greedy, Accepted,
alloc_verify_slots, commit_accepted, and the draft-model building blocks (decoder layer, weight
loading, a second attention backend, the shared graph pool).
"""

from backplane.speculative.accept import Accepted, verify_greedy
from backplane.speculative.context import SpecContext, TargetRunner
from backplane.speculative.draft_parts import (
    graph_pool,
    iterate_safetensors,
    llama_decoder_layer,
    load_config,
    load_named_weights,
    make_attention_backend,
    padded_size,
    pool_bytes,
)
from backplane.speculative.kv import alloc_verify_slots, commit_accepted
from backplane.speculative.tree import DraftTree, ancestor_matrix, verify_mask
from backplane.speculative.worker import SpecStats, SpecWorker

__all__ = [
    "Accepted",
    "DraftTree",
    "SpecContext",
    "SpecStats",
    "SpecWorker",
    "TargetRunner",
    "alloc_verify_slots",
    "ancestor_matrix",
    "commit_accepted",
    "graph_pool",
    "iterate_safetensors",
    "llama_decoder_layer",
    "load_config",
    "load_named_weights",
    "make_attention_backend",
    "padded_size",
    "pool_bytes",
    "verify_greedy",
    "verify_mask",
]
