"""Mixtral, Qwen2-MoE and Qwen3-MoE decoders on the public model API.

Each is a Llama-family decoder (`backplane.models.llama.LlamaAttention`: fused q/k/v, rotary,
Qwen2's q/k/v biases, Qwen3's per-head q/k norms) whose MLP is a `FusedMoE` (backplane.layers):

- Mixtral: every layer's `block_sparse_moe` routes each token to `num_experts_per_tok` of
  `num_local_experts` experts (`w1` gate, `w3` up, `w2` down), weights renormalised to sum to 1.
- Qwen2-MoE: `mlp` with `num_experts` experts (`gate_proj`, `up_proj`, `down_proj`), a shared expert
  every token goes through, scaled by sigmoid(`shared_expert_gate`); renormalised when
  `norm_topk_prob`. Layers listed in `mlp_only_layers`, or off the `decoder_sparse_step`, keep a
  dense MLP of `intermediate_size`.
- Qwen3-MoE: Qwen2-MoE's routing without the shared expert, with Qwen3's q/k norms.

Checkpoints load as they are: one tensor per expert and projection, stacked at load
(`expert_params_mapping`). LoRA applies to the attention projections (and to the dense MLP layers);
the experts have no LoRA wrapper.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from backplane.contracts import ForwardBatch
from backplane.layers import FusedMoE, LogitsProcessor, ParallelLMHead, RMSNorm
from backplane.layers import expert_params_mapping
from backplane.models import STACKED_PARAMS, ModelContext, ModelOutput, llama_checkpoint_shapes, load_named_weights
from backplane.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaModel


class MoeDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm decoder layer whose MLP is the layer's MoE block (or a dense MLP), kept under
    the checkpoint's module name (`block_sparse_moe` for Mixtral, `mlp` for Qwen)."""

    def __init__(self, config, layer_id: int, ctx: ModelContext, family: type[MoeForCausalLM]):
        nn.Module.__init__(self)  # not LlamaDecoderLayer's: it would build a dense MLP every layer
        self.self_attn = LlamaAttention(config, layer_id, ctx, family.qkv_bias_of(config), family.qk_norm)
        self.mlp_name = family.mlp_name
        if family.is_sparse(config, layer_id):
            setattr(self, self.mlp_name, family.moe_block(config, layer_id, ctx))
        else:
            setattr(self, self.mlp_name, LlamaMLP(config, ctx))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx, ctx.dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx, ctx.dtype)

    def feed_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.mlp_name)(hidden)


class MoeForCausalLM(nn.Module):
    """forward(batch) -> ModelOutput. The class attributes and class methods say what differs per
    family; sizing attributes for the KV pool are per tensor-parallel rank."""

    mlp_name = "mlp"  # the MoE block's module name in the checkpoint
    expert_names = ("gate_proj", "up_proj", "down_proj")  # each expert's gate, up and down
    qk_norm = False

    @classmethod
    def qkv_bias_of(cls, config) -> bool:
        return False

    @classmethod
    def num_experts_of(cls, config) -> int:
        return config.num_experts

    @classmethod
    def is_sparse(cls, config, layer_id: int) -> bool:
        """Qwen's rule: a MoE block unless listed in mlp_only_layers or off the decoder_sparse_step."""
        step = getattr(config, "decoder_sparse_step", 1) or 1
        dense = getattr(config, "mlp_only_layers", None) or []
        return layer_id not in dense and cls.num_experts_of(config) > 0 and (layer_id + 1) % step == 0

    @classmethod
    def expert_intermediate_size_of(cls, config) -> int:
        return config.moe_intermediate_size

    @classmethod
    def shared_expert_size_of(cls, config) -> int:
        """The shared expert's intermediate size (0: none); it is gated by sigmoid(shared_expert_gate)."""
        return 0

    @classmethod
    def renormalize_of(cls, config) -> bool:
        return bool(getattr(config, "norm_topk_prob", False))

    @classmethod
    def moe_block(cls, config, layer_id: int, ctx: ModelContext) -> FusedMoE:
        shared = cls.shared_expert_size_of(config)
        return FusedMoE(cls.num_experts_of(config), config.num_experts_per_tok, config.hidden_size,
                        cls.expert_intermediate_size_of(config), ctx, layer_id=layer_id,
                        renormalize=cls.renormalize_of(config), shared_expert_intermediate_size=shared,
                        shared_expert_gated=shared > 0)

    def __init__(self, config, ctx: ModelContext):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act: expected 'silu' for {type(self).__name__}, got {config.hidden_act!r}")
        self.config, self.ctx = config, ctx
        family = type(self)
        self.model = LlamaModel(config, ctx, family.qkv_bias_of(config), family.qk_norm,
                                decoder_layer=lambda i: MoeDecoderLayer(config, i, ctx, family))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, ctx.parallel, ctx.dtype)
        self.logits_processor = LogitsProcessor(config.vocab_size, ctx.parallel)
        first_attn = self.model.layers[0].self_attn
        self.num_layers = config.num_hidden_layers
        self.num_heads, self.num_kv_heads = first_attn.qkv_proj.num_heads, first_attn.qkv_proj.num_kv_heads
        self.head_dim = first_attn.head_dim
        self.hidden_size, self.vocab_size = config.hidden_size, config.vocab_size

    def forward(self, batch: ForwardBatch) -> ModelOutput:
        """The bound ForwardContext (if any) says where the logits go and whether hidden states return."""
        bound = self.ctx.forward
        hidden = self.model(batch.input_ids, batch.positions, batch)  # [T, hidden_size]
        logits = self.logits_processor(hidden, self.lm_head, batch, out=bound.logits_out if bound else None)
        return ModelOutput(logits, hidden if bound is not None and bound.capture_hidden else None)

    @property
    def stacked_params(self) -> list[tuple[str, str, object]]:
        """The experts' tensors onto the stacked w13/w2 (first: a dense `.gate_proj.` entry would match
        them too), then the Llama family's q/k/v and gate/up."""
        gate, up, down = self.expert_names
        return expert_params_mapping(self.num_experts_of(self.config), gate, up, down) + list(STACKED_PARAMS)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> set[str]:
        """Load (hf_name, full tensor) pairs into the fused, stacked, rank-local parameters; returns
        the names loaded."""
        return load_named_weights(self, weights, strict=strict, stacked_params=self.stacked_params)

    def checkpoint_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every tensor of a Hugging Face checkpoint of this model with its full (unsplit) shape."""
        return moe_checkpoint_shapes(self.config, type(self))


class MixtralForCausalLM(MoeForCausalLM):
    mlp_name = "block_sparse_moe"
    expert_names = ("w1", "w3", "w2")

    @classmethod
    def num_experts_of(cls, config) -> int:
        return config.num_local_experts

    @classmethod
    def is_sparse(cls, config, layer_id: int) -> bool:
        return True

    @classmethod
    def expert_intermediate_size_of(cls, config) -> int:
        return config.intermediate_size

    @classmethod
    def renormalize_of(cls, config) -> bool:
        return True


class Qwen2MoeForCausalLM(MoeForCausalLM):
    @classmethod
    def qkv_bias_of(cls, config) -> bool:
        return bool(getattr(config, "qkv_bias", True))  # transformers 4.x: always

    @classmethod
    def shared_expert_size_of(cls, config) -> int:
        return config.shared_expert_intermediate_size or 0


class Qwen3MoeForCausalLM(MoeForCausalLM):
    qk_norm = True


def moe_checkpoint_shapes(config, family: type[MoeForCausalLM]) -> list[tuple[str, tuple[int, ...]]]:
    """Names and full shapes of a Hugging Face checkpoint of `family`: the Llama family's, with each
    sparse layer's dense MLP replaced by its router, experts and shared expert."""
    shapes = []
    sparse = {f"model.layers.{i}.mlp.": i for i in range(config.num_hidden_layers) if family.is_sparse(config, i)}
    for name, shape in llama_checkpoint_shapes(config, family.qkv_bias_of(config), family.qk_norm):
        prefix = name[: name.find(".mlp.") + len(".mlp.")] if ".mlp." in name else None
        if prefix not in sparse:
            shapes.append((name, shape))
        elif name.endswith(".mlp.gate_proj.weight"):  # the first of the layer's MLP tensors
            shapes += _moe_block_shapes(config, family, sparse[prefix])
    return shapes


def _moe_block_shapes(config, family: type[MoeForCausalLM], layer_id: int) -> list[tuple[str, tuple[int, ...]]]:
    hidden, num_experts = config.hidden_size, family.num_experts_of(config)
    inter, shared = family.expert_intermediate_size_of(config), family.shared_expert_size_of(config)
    p = f"model.layers.{layer_id}.{family.mlp_name}."
    gate, up, down = family.expert_names
    shapes = [(f"{p}gate.weight", (num_experts, hidden))]
    for e in range(num_experts):
        shapes += [(f"{p}experts.{e}.{gate}.weight", (inter, hidden)), (f"{p}experts.{e}.{up}.weight", (inter, hidden)),
                   (f"{p}experts.{e}.{down}.weight", (hidden, inter))]
    if shared:
        shapes += [(f"{p}shared_expert.gate_proj.weight", (shared, hidden)),
                   (f"{p}shared_expert.up_proj.weight", (shared, hidden)),
                   (f"{p}shared_expert.down_proj.weight", (hidden, shared)),
                   (f"{p}shared_expert_gate.weight", (1, hidden))]
    return shapes


def build_model(cls: type[MoeForCausalLM], hf_config, ctx: ModelContext) -> MoeForCausalLM:
    """Create `cls` with its parameters on ctx.device in ctx.dtype (uninitialised until loaded)."""
    with torch.device(ctx.device):
        return cls(hf_config, ctx).eval()
