"""Speculative decoding: the SpecWorker contract and the helpers every algorithm shares.

Public for algorithm plugins: SpecWorker, SpecContext, TargetRunner (what an algorithm reads of
the target; TargetView, the core's facade that implements it), SpecRequest (what an algorithm
sees of one request), SpecStats and RequestAcceptance, DraftTree, verify_mask, verify_greedy,
Accepted, alloc_verify_slots, commit_accepted, and the draft-model building blocks (decoder
layer, weight loading, a second attention backend, the shared graph pool).
"""

from backplane.speculative.accept import Accepted, verify_greedy
from backplane.speculative.context import SpecContext
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
from backplane.speculative.request import RequestAcceptance, SpecRequest
from backplane.speculative.stats import SpecStats
from backplane.speculative.target import TargetRunner, TargetView
from backplane.speculative.tree import DraftTree, ancestor_matrix, verify_mask
from backplane.speculative.worker import SpecWorker

__all__ = [
    "Accepted",
    "DraftTree",
    "RequestAcceptance",
    "SpecContext",
    "SpecRequest",
    "SpecStats",
    "SpecWorker",
    "TargetRunner",
    "TargetView",
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
