"""The mixture-of-experts layer: the router, the experts' stacked weights, an optional shared expert.

`FusedMoE` owns what the model decides (backplane.contracts.moe): the router `gate` (a replicated
H -> E linear in the model's dtype, never quantized), softmax / top-k / renormalisation
(`backplane.moe.route`'s arithmetic, run as the resolved `moe_route` custom op, `ctx.ops.moe_route`),
the shared expert and its sigmoid gate (Qwen2-MoE), and the one all-reduce of the partial sums under
tensor parallelism. The experts' arithmetic goes to the model's MoE
backend (`ctx.moe_backend`, chosen by `--moe-backend`) through `backplane.moe.moe_experts`.

Checkpoints keep one tensor per expert and projection (`...experts.3.gate_proj.weight`); they are
stacked at load into `w13_weight` [E, 2 * I_local, H] (gate rows, then up rows) and `w2_weight`
[E, H, I_local], I_local this rank's slice of the intermediate size. `expert_params_mapping` gives
the (parameter part, checkpoint part, shard id) triples `backplane.models.load_named_weights`
takes, so a MoE model loads with the same helper as a dense one:

    mapping = expert_params_mapping(num_experts, "gate_proj", "up_proj", "down_proj")
    load_named_weights(model, weights, stacked_params=mapping + list(STACKED_PARAMS))

Quantized experts: `set_expert_quant(ExpertQuant)` (the core calls it when the run's quantization
method describes the experts, before loading) makes the stacked weights FP8 and adds the scales
`w13_<scale_name>` / `w2_<scale_name>`; the same mapping then loads each expert's
`...experts.3.gate_proj.weight_scale_inv` into the rows of `w13_weight_scale_inv` that hold expert 3's
gate blocks. Online quantization keeps the weights in the model dtype until
`process_weights_after_loading`, which quantizes them per channel.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from backplane.contracts.moe import MoeLayerInfo
from backplane.contracts.quant import ExpertQuant
from backplane.layers.activation import SiluAndMul
from backplane.layers.linear import MergedColumnParallelLinear, RowParallelLinear, copy_checked
from backplane.layers.parallel import divide
from backplane.moe import moe_experts, register_moe_layer
from backplane.moe.quant import quantize_experts_per_block, quantize_experts_per_channel

EXPERT_SHARDS = ("w1", "w2", "w3")  # gate, down, up (Mixtral's names; any model's gate/down/up)


def expert_params_mapping(num_experts: int, gate_name: str, up_name: str, down_name: str,
                          experts_prefix: str = "experts") -> list[tuple[str, str, tuple[int, str]]]:
    """(parameter part, checkpoint part, shard id) for every expert's three checkpoint tensors.

    The checkpoint part `.{experts_prefix}.{e}.{gate_name}.` loads into `.w13_` (shard id (e, "w1")),
    `.{up_name}.` into `.w13_` ((e, "w3")) and `.{down_name}.` into `.w2_` ((e, "w2")) of the
    FusedMoE module that holds the experts: `model.layers.0.mlp.experts.3.gate_proj.weight` ->
    `model.layers.0.mlp.w13_weight`. Put these before the model's other stacked params (a dense
    `.gate_proj.` entry would also match an expert's name).
    """
    mapping = []
    for expert in range(num_experts):
        for name, param, shard in ((gate_name, "w13", "w1"), (up_name, "w13", "w3"), (down_name, "w2", "w2")):
            mapping.append((f".{param}_", f".{experts_prefix}.{expert}.{name}.", (expert, shard)))
    return mapping


class ReplicatedLinear(nn.Module):
    """y = x W^T with the whole W on every rank ([out, in], no bias): the router and the shared
    expert's gate. Not a core linear layer, so quantization and LoRA leave it alone."""

    def __init__(self, input_size: int, output_size: int, params_dtype=None):
        super().__init__()
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class SharedExpert(nn.Module):
    """A SwiGLU MLP every token goes through (Qwen2-MoE): this rank's partial sum, not all-reduced
    (the MoE layer reduces it together with the experts')."""

    def __init__(self, hidden_size: int, intermediate_size: int, ctx, params_dtype):
        super().__init__()
        sizes = [intermediate_size, intermediate_size]
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, sizes, False, ctx.parallel, params_dtype)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False, ctx.parallel, params_dtype,
                                           reduce_results=False)
        self.act_fn = SiluAndMul(ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class FusedMoE(nn.Module):
    """x [T, H] -> [T, H]: sum over the k chosen experts of weight * down(silu(gate(x)) * up(x)),
    plus the shared expert (times sigmoid(shared_expert_gate(x)) when gated), all-reduced over ranks.

    num_experts: E; top_k: experts per token; intermediate_size: each expert's full I (split over
    tensor-parallel ranks); renormalize: the k router weights are divided by their sum (Mixtral;
    Qwen's `norm_topk_prob`); shared_expert_intermediate_size: 0 for none; shared_expert_gate: the
    shared expert is scaled by a sigmoid gate (H -> 1); params_dtype: default ctx.dtype.

    Parameters: `gate.weight` [E, H] (the router), `w13_weight` [E, 2 * I_local, H], `w2_weight`
    [E, H, I_local], and `shared_expert.{gate_up_proj,down_proj}`, `shared_expert_gate.weight`
    [1, H] when present. `moe_info` is what the backend is told of the layer; `handle` names it to
    the opaque op under torch.compile.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, ctx, *,
                 layer_id: int, renormalize: bool, shared_expert_intermediate_size: int = 0,
                 shared_expert_gated: bool = False, params_dtype=None):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"FusedMoE layer {layer_id}: top_k {top_k} out of range; expected 1 <= top_k <= "
                             f"num_experts ({num_experts})")
        if shared_expert_gated and not shared_expert_intermediate_size:
            raise ValueError(f"FusedMoE layer {layer_id}: shared_expert_gated needs a shared expert; expected "
                             "shared_expert_intermediate_size > 0")
        dtype = params_dtype or ctx.dtype
        parallel = ctx.parallel
        local = divide(intermediate_size, parallel.tp_size, f"MoE layer {layer_id} expert intermediate size")
        self.ctx, self.num_experts, self.top_k, self.renormalize = ctx, num_experts, top_k, renormalize
        self.hidden_size, self.intermediate_size_per_partition = hidden_size, local
        self.gate = ReplicatedLinear(hidden_size, num_experts, dtype)
        self.w13_weight = self._expert_param((num_experts, 2 * local, hidden_size), dtype)
        self.w2_weight = self._expert_param((num_experts, hidden_size, local), dtype)
        self.shared_expert = None
        self.shared_expert_gate = None
        if shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(hidden_size, shared_expert_intermediate_size, ctx, dtype)
            if shared_expert_gated:
                self.shared_expert_gate = ReplicatedLinear(hidden_size, 1, dtype)
        self.moe_info = MoeLayerInfo(
            layer_id=layer_id, num_experts=num_experts, top_k=top_k, hidden_size=hidden_size,
            intermediate_size=intermediate_size, intermediate_size_per_partition=local, renormalize=renormalize,
            params_dtype=dtype, device=self.w13_weight.device, tp_rank=parallel.tp_rank, tp_size=parallel.tp_size)
        self.handle = register_moe_layer(self)  # for torch.ops.backplane.moe_experts under torch.compile

    def _expert_param(self, shape: tuple[int, ...], dtype, device=None) -> nn.Parameter:
        param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
        param.weight_loader = self.weight_loader
        return param

    @property
    def expert_quant(self) -> ExpertQuant | None:
        """How the experts are quantized (None: the model dtype); `moe_info.quant`."""
        return self.moe_info.quant

    def set_expert_quant(self, quant: ExpertQuant) -> None:
        """Store the experts as `quant` describes, before the checkpoint is read: `w13_weight` /
        `w2_weight` in quant.weight_dtype (the model dtype until processed when online) and their
        fp32 scales `w13_<scale_name>` / `w2_<scale_name>`. A block that does not divide this rank's
        sizes is a ValueError."""
        num_experts, hidden, local = self.num_experts, self.hidden_size, self.intermediate_size_per_partition
        device = self.w13_weight.device
        if quant.online and quant.scales == "block":
            self._check_blocks(quant.block)
        if not quant.online:
            self.w13_weight = self._expert_param(tuple(self.w13_weight.shape), quant.weight_dtype, device)
            self.w2_weight = self._expert_param(tuple(self.w2_weight.shape), quant.weight_dtype, device)
            if quant.scales == "block":
                self._check_blocks(quant.block)
                bn, bk = quant.block
                w13_scale, w2_scale = (num_experts, 2 * local // bn, hidden // bk), (num_experts, hidden // bn, local // bk)
            else:
                w13_scale, w2_scale = (num_experts, 2 * local), (num_experts, hidden)
            self.register_parameter(f"w13_{quant.scale_name}", self._expert_param(w13_scale, torch.float32, device))
            self.register_parameter(f"w2_{quant.scale_name}", self._expert_param(w2_scale, torch.float32, device))
        self.moe_info = dataclasses.replace(self.moe_info, quant=quant)

    def _check_blocks(self, block: tuple[int, int]) -> None:
        sizes = {"hidden size": self.hidden_size, "intermediate size per rank": self.intermediate_size_per_partition}
        bad = [f"{name} {size}" for name, size in sizes.items() if size % block[0] or size % block[1]]
        if bad:
            raise ValueError(f"MoE layer {self.moe_info.layer_id}: expert weight blocks {list(block)} do not divide the "
                             f"{', '.join(bad)}; expected both to be multiples of the block's rows and columns")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> [T, H] (the same on every rank)."""
        router_logits = self.gate(x)  # [T, E], model dtype
        # backplane.moe.route's arithmetic through the resolved op (top_k was checked at init)
        topk_weights, topk_ids = self.ctx.ops.moe_route(router_logits, self.top_k, self.renormalize)  # [T, k] fp32/int32
        out = moe_experts(self, x, topk_weights, topk_ids)  # [T, H], this rank's partial sum
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return self.ctx.parallel.all_reduce(out)

    def process_weights_after_loading(self) -> None:
        """Once after the checkpoint is read: online quantization of the experts (per channel or block), then
        the MoE backend's re-layout of the experts' weights."""
        quant = self.expert_quant
        if quant is not None and quant.online and self.w13_weight.dtype != quant.weight_dtype:
            for name in ("w13", "w2"):
                weight = getattr(self, f"{name}_weight").data
                q, scale = (quantize_experts_per_block(weight, quant.weight_dtype, quant.block) if quant.scales == "block"
                            else quantize_experts_per_channel(weight, quant.weight_dtype))
                setattr(self, f"{name}_weight", nn.Parameter(q, requires_grad=False))
                self.register_parameter(f"{name}_{quant.scale_name}", nn.Parameter(scale, requires_grad=False))
        self.ctx.moe_backend.process_weights_after_loading(self)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: tuple[int, str]) -> None:
        """Copy one expert's full checkpoint tensor into its rows of `param`, keeping this rank's slice.

        shard_id: (expert id, "w1" | "w3" | "w2"): "w1" (gate) and "w3" (up) are [I, H] and fill the
        first / second I_local rows of `w13_weight[e]`; "w2" (down) is [H, I] and fills `w2_weight[e]`
        with this rank's I_local columns.
        """
        expert, shard = self._checked_shard(shard_id)
        local, rank = self.intermediate_size_per_partition, self.ctx.parallel.tp_rank
        full = local * self.ctx.parallel.tp_size
        what = f"MoE layer {self.moe_info.layer_id} expert {expert} {shard}"
        if param is not self.w13_weight and param is not self.w2_weight:
            return self._load_scale(param, loaded_weight, expert, shard, what)
        self._check_dtype(param, loaded_weight, what)
        if shard == "w2":
            self._check_full(loaded_weight, (self.hidden_size, full), what)
            return copy_checked(param[expert], loaded_weight.narrow(1, rank * local, local), what)
        self._check_full(loaded_weight, (full, self.hidden_size), what)
        rows = param[expert].narrow(0, 0 if shard == "w1" else local, local)
        copy_checked(rows, loaded_weight.narrow(0, rank * local, local), what)

    def _check_dtype(self, param: nn.Parameter, loaded: torch.Tensor, what: str) -> None:
        """A quantized checkpoint weight goes only into a parameter of its dtype: copied into the model
        dtype it would lose its scale silently."""
        if loaded.dtype.itemsize == 1 and loaded.is_floating_point() and param.dtype != loaded.dtype:
            raise ValueError(f"{what}: the checkpoint holds {loaded.dtype} expert weights but this run keeps the experts "
                             f"in {param.dtype}; expected a quantization method (--quantization) that describes "
                             "quantized experts")

    def _load_scale(self, param: nn.Parameter, loaded: torch.Tensor, expert: int, shard: str, what: str) -> None:
        """One expert's checkpoint scale into its rows of a w13 / w2 scale (ExpertQuant's layout).

        Per channel ([N, 1], [N] or one per-tensor value filling every row of the part): gate / up
        fill the first / second I_local entries of w13's, down all H of w2's. Per block
        ([N / bn, K / bk]): gate / up fill the first / second I_local / bn block rows of w13's (this
        rank's), down this rank's I_local / bk block columns of w2's."""
        quant = self.expert_quant
        local, rank, tp = self.intermediate_size_per_partition, self.ctx.parallel.tp_rank, self.ctx.parallel.tp_size
        loaded = loaded.float()
        if quant.scales == "channel":
            rows = self.hidden_size if shard == "w2" else local * tp
            if loaded.numel() == 1:
                loaded = loaded.reshape(1).expand(rows)
            self._check_full(loaded.reshape(-1), (rows,), f"{what} scale")
            loaded = loaded.reshape(-1)
            if shard == "w2":
                return copy_checked(param[expert], loaded, f"{what} scale")
            part = param[expert].narrow(0, 0 if shard == "w1" else local, local)
            return copy_checked(part, loaded.narrow(0, rank * local, local), f"{what} scale")
        bn, bk = quant.block
        if shard == "w2":
            self._check_full(loaded, (self.hidden_size // bn, local * tp // bk), f"{what} scale")
            return copy_checked(param[expert], loaded.narrow(1, rank * local // bk, local // bk), f"{what} scale")
        self._check_full(loaded, (local * tp // bn, self.hidden_size // bk), f"{what} scale")
        blocks = local // bn
        part = param[expert].narrow(0, 0 if shard == "w1" else blocks, blocks)
        copy_checked(part, loaded.narrow(0, rank * blocks, blocks), f"{what} scale")

    def _checked_shard(self, shard_id) -> tuple[int, str]:
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2 and shard_id[1] in EXPERT_SHARDS):
            raise ValueError(f"FusedMoE.weight_loader: shard_id must be (expert id, one of {', '.join(EXPERT_SHARDS)}), "
                             f"got {shard_id!r}")
        expert, shard = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"MoE layer {self.moe_info.layer_id}: expert id {expert} out of range; expected "
                             f"0 <= id < {self.num_experts} (the config's number of experts)")
        return expert, shard

    @staticmethod
    def _check_full(loaded: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
        if tuple(loaded.shape) != shape:
            raise ValueError(f"{what}: expected the full checkpoint tensor of shape {shape}, got {tuple(loaded.shape)}")

    def extra_repr(self) -> str:
        info = self.moe_info
        return (f"experts={info.num_experts}, top_k={info.top_k}, hidden={info.hidden_size}, "
                f"intermediate={info.intermediate_size_per_partition}/{info.intermediate_size}, "
                f"renormalize={info.renormalize}" + (f", quant={info.quant}" if info.quant else ""))
