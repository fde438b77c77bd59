"""Mapping Hugging Face checkpoint tensors onto fused, rank-local parameters.

`load_named_weights` serves any model built from backplane.layers: a checkpoint name containing a
`stacked_params` entry's original part (".q_proj.") loads into the fused parameter (".qkv_proj.")
through that parameter's `weight_loader(param, tensor, shard_id)`, which keeps this rank's shard.
The defaults are the Llama family's (q/k/v into qkv_proj, gate/up into gate_up_proj).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
from torch import nn

from backplane.layers.linear import copy_checked
from backplane.models.config_utils import head_dim_of, num_kv_heads_of

# (fused parameter, checkpoint name, shard id) — e.g. ".q_proj." loads into ".qkv_proj." as "q".
STACKED_PARAMS = (
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
TIED_PAIR = ("model.embed_tokens.weight", "lm_head.weight")


def _target(hf_name: str, stacked_params=STACKED_PARAMS) -> tuple[str, object]:
    """(parameter name, shard id or None) for a checkpoint tensor name."""
    for fused, original, shard_id in stacked_params:
        if original in hf_name:
            return hf_name.replace(original, fused), shard_id
    return hf_name, None


def check_cast(param: nn.Parameter, tensor: torch.Tensor, hf_name: str) -> None:
    """Refuse a checkpoint tensor whose values the cast to the run's dtype turns into infinity
    (float32 weights beyond float16's range, loaded with --dtype float16)."""
    if not tensor.is_floating_point() or not param.is_floating_point() or tensor.dtype == param.dtype:
        return
    limit = torch.finfo(param.dtype).max
    if limit >= torch.finfo(tensor.dtype).max:
        return
    largest = float(tensor.abs().max()) if tensor.numel() else 0.0
    if largest > limit:
        dtype = str(param.dtype).removeprefix("torch.")
        raise ValueError(f"checkpoint tensor {hf_name!r}: holds {largest:.4g}, beyond {dtype}'s largest value "
                         f"{limit:.4g}, so loading it as {dtype} gives infinity; expected --dtype float32 or bfloat16")


class TiedCheck:
    """With tie_word_embeddings, the checkpoint's lm_head.weight (if any) must equal the embedding:
    a different one would be dropped silently. Holds the first of the two until the second comes."""

    def __init__(self):
        self.first: tuple[str, torch.Tensor] | None = None

    def see(self, hf_name: str, tensor: torch.Tensor) -> None:
        if hf_name not in TIED_PAIR:
            return
        if self.first is None:
            self.first = (hf_name, tensor)
            return
        if not torch.equal(self.first[1], tensor):
            raise ValueError("checkpoint tensor 'lm_head.weight' differs from 'model.embed_tokens.weight' but "
                             "config.json sets tie_word_embeddings: true; expected false (to use the separate "
                             "lm_head) or a checkpoint without lm_head.weight")
        self.first = None


def _load_one(param: nn.Parameter, tensor: torch.Tensor, shard_id, hf_name: str) -> None:
    check_cast(param, tensor, hf_name)
    loader = getattr(param, "weight_loader", None)
    if loader is None:
        copy_checked(param, tensor, f"weight {hf_name!r}")
    elif shard_id is None:
        loader(param, tensor)
    else:
        loader(param, tensor, shard_id)


def load_named_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True,
    stacked_params: Sequence[tuple[str, str, object]] = STACKED_PARAMS,
    ignored_suffixes: tuple[str, ...] = IGNORED_SUFFIXES,
) -> set[str]:
    """Load (hf_name, full tensor) pairs into `model`; returns the names of the parameters loaded.

    stacked_params: (fused part, checkpoint part, shard id) triples, e.g. (".qkv_proj.", ".q_proj.",
    "q"): the tensor goes to the fused parameter's `weight_loader` with that shard id. A parameter
    with a `weight_loader` gets the full tensor and keeps its tensor-parallel shard; one without is
    copied whole. ignored_suffixes: checkpoint names to skip (rotary inverse frequencies).

    Tied embeddings: a checkpoint `lm_head.weight` equal to the embedding is skipped (the embedding
    is used); a different one is a ValueError. strict: an unknown checkpoint name, or a parameter
    left unloaded, is a ValueError naming it. A value the cast to the parameter's dtype would make
    infinite is a ValueError naming the tensor and the dtype.
    """
    params = dict(model.named_parameters())
    tied = getattr(model, "tie_word_embeddings", False)
    tied_check = TiedCheck()
    loaded: set[str] = set()
    for hf_name, tensor in weights:
        if tied:
            tied_check.see(hf_name, tensor)
        if hf_name.endswith(ignored_suffixes) or (tied and hf_name == "lm_head.weight"):
            continue
        name, shard_id = _target(hf_name, stacked_params)
        if name not in params:
            if strict:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no parameter in {type(model).__name__}")
            continue
        _load_one(params[name], tensor, shard_id, hf_name)
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if strict and missing:
        raise ValueError(f"{type(model).__name__}: the checkpoint has no weights for {', '.join(missing[:8])}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    return loaded


def llama_checkpoint_shapes(config, qkv_bias: bool, qk_norm: bool) -> list[tuple[str, tuple[int, ...]]]:
    """Names and full shapes of a Hugging Face Llama-family checkpoint, in a fixed order."""
    hidden, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    head_dim = head_dim_of(config)
    q_size = config.num_attention_heads * head_dim
    kv_size = num_kv_heads_of(config) * head_dim
    attn_bias = bool(getattr(config, "attention_bias", False))
    mlp_bias = bool(getattr(config, "mlp_bias", False))
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        for proj, size in (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)):
            shapes.append((f"{p}self_attn.{proj}.weight", (size, hidden)))
            if qkv_bias or attn_bias:
                shapes.append((f"{p}self_attn.{proj}.bias", (size,)))
        shapes.append((f"{p}self_attn.o_proj.weight", (hidden, q_size)))
        if attn_bias:
            shapes.append((f"{p}self_attn.o_proj.bias", (hidden,)))
        if qk_norm:
            shapes += [(f"{p}self_attn.q_norm.weight", (head_dim,)), (f"{p}self_attn.k_norm.weight", (head_dim,))]
        mlp = (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter)))
        for proj, shape in mlp:
            shapes.append((f"{p}mlp.{proj}.weight", shape))
            if mlp_bias:
                shapes.append((f"{p}mlp.{proj}.bias", shape[:1]))
        shapes += [(f"{p}input_layernorm.weight", (hidden,)), (f"{p}post_attention_layernorm.weight", (hidden,))]
    shapes.append(("model.norm.weight", (hidden,)))
    if not getattr(config, "tie_word_embeddings", False):
        shapes.append(("lm_head.weight", (vocab, hidden)))
    return shapes
