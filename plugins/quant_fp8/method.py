"""Fp8LinearMethod: one linear layer's FP8 weight, its scales, and the matmul.

Parameters (named as in the checkpoint; each with its ShardLayout so tensor parallelism splits it):
  weight [N_local, K_local] float8_e4m3fn (online: the model dtype until processed)
  per-tensor: weight_scale [parts] (one per fused part), requantized to one scalar after loading
  per-channel: weight_scale [N_local, 1], split with the output rows
  block: weight_scale_inv (or weight_scale) [ceil(N / bn), ceil(K / bk)], split by blocks
  static activations: input_scale [parts], their maximum after loading
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from backplane.contracts import LinearPartition, QuantMethod, ShardLayout, new_parameter
from backplane.plugins.quant_fp8 import quantize as fq
from backplane.plugins.quant_fp8.options import BUNDLED, TableSource
from backplane.plugins.quant_fp8.reference import reference_linear
from backplane.plugins.quant_fp8.scheme import Fp8Scheme

logger = logging.getLogger(__name__)

WEIGHT = ShardLayout(output_dim=0, input_dim=1)
PER_CHANNEL = ShardLayout(output_dim=0)
PER_PART = ShardLayout(output_dim=None, per_partition=True)


class Fp8LinearMethod(QuantMethod):
    """FP8 weights of the layer named `prefix` under `scheme` (backplane.plugins.quant_fp8.config); on
    CUDA its launches come from `table` (the config's `--fp8.configs` / `--fp8.tuned`)."""

    def __init__(self, scheme: Fp8Scheme, prefix: str = "", table: TableSource = BUNDLED):
        self.scheme = scheme
        self.prefix = prefix
        self.table = table

    def __repr__(self) -> str:
        return f"Fp8LinearMethod({self.prefix!r}, {self.scheme})"

    # -- weights ---------------------------------------------------------------------------------

    def create_weights(self, layer: nn.Module, partition: LinearPartition) -> None:
        parts, k = partition.output_partition_sizes, partition.input_size_per_partition
        n, device, scheme = sum(parts), partition.device, self.scheme
        if scheme.online:
            if scheme.weights == "block":
                self._check_online_blocks(parts, k)
            layer.register_parameter("weight", new_parameter(torch.empty(n, k, dtype=partition.params_dtype,
                                                                         device=device), WEIGHT))
            return
        layer.register_parameter("weight", new_parameter(torch.empty(n, k, dtype=fq.FP8, device=device), WEIGHT))
        if scheme.weights == "tensor":
            scale = new_parameter(torch.ones(len(parts), device=device), PER_PART)
        elif scheme.weights == "channel":
            scale = new_parameter(torch.ones(n, 1, device=device), PER_CHANNEL)
        else:
            scale = new_parameter(self._block_scale(partition), ShardLayout(0, 1, *scheme.block))
        layer.register_parameter(scheme.scale_name, scale)
        if scheme.static_input:
            layer.register_parameter("input_scale", new_parameter(torch.ones(len(parts), device=device), PER_PART))

    def _block_scale(self, partition: LinearPartition) -> torch.Tensor:
        bn, bk = self.scheme.block
        k = partition.input_size_per_partition
        if k % bk:
            raise ValueError(f"layer {self.prefix}: input size {k} (per rank) is not a multiple of the weight block's "
                             f"{bk} columns; expected quantization_config's block to divide it")
        rows = sum(-(-p // bn) for p in partition.output_partition_sizes)
        return torch.ones(rows, k // bk, device=partition.device)

    def _check_online_blocks(self, parts: tuple[int, ...] | list[int], k: int) -> None:
        """Online blocks tile every part of this rank's weight exactly (a block never spans q and k)."""
        bn, bk = self.scheme.block
        if k % bk or any(p % bn for p in parts):
            raise ValueError(f"--fp8.online-block {bn}x{bk}: layer {self.prefix} has parts of {list(parts)} rows and "
                             f"{k} columns (per rank); expected every part a multiple of {bn} and the columns of {bk}")

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        scheme = self.scheme
        if scheme.online and scheme.weights == "block":
            self._quantize_blocks(layer)
        elif scheme.online:
            weight, scale = fq.quantize_weight_per_channel(layer.weight.data)
            layer.weight = new_parameter(weight, WEIGHT)
            layer.weight_scale = new_parameter(scale, PER_CHANNEL)
        elif scheme.weights == "tensor":
            self._one_tensor_scale(layer)
        if scheme.static_input:
            layer.input_scale = new_parameter(layer.input_scale.data.max().reshape(()), PER_PART)
        self.use_cuda = _fp8_matmul_device(layer.weight.device)
        if self.use_cuda:  # the split-K kernels' tile counters, one set per layer (no zero-fill per call)
            from backplane.plugins.quant_fp8.kernels import new_counters

            self.counters = new_counters(layer.weight)
            from backplane.plugins.quant_fp8.cuda import unit_scale

            unit_scale(layer.weight.device)  # the tensor-wise path's 1.0, made before any capture
            from backplane.plugins.quant_fp8.opaque import scheme_key  # registers torch.ops.backplane_fp8.linear

            self.scheme_key = scheme_key(self.scheme, self.table)

    def _quantize_blocks(self, layer: nn.Module) -> None:
        """The loaded weight -> FP8 blocks. Every part is a multiple of the block's rows
        (_check_online_blocks), so the whole weight's blocks are each part's, as a checkpoint has them."""
        bn, bk = self.scheme.block
        weight, scale = fq.quantize_weight_blocks(layer.weight.data, bn, bk)
        layer.weight = new_parameter(weight, WEIGHT)
        layer.register_parameter(self.scheme.scale_name, new_parameter(scale, ShardLayout(0, 1, bn, bk)))

    def _one_tensor_scale(self, layer: nn.Module) -> None:
        """Per-part scales of a fused layer -> one scale, their maximum: each part is requantized to it
        (what _scaled_mm's single weight scale needs; exact up to one FP8 rounding of each weight)."""
        scales = layer.weight_scale.data.float()
        top = scales.max()
        if bool((scales != top).any()):
            parts = layer.partition().output_partition_sizes
            rows = [p.float() * s / top for p, s in zip(layer.weight.data.split(list(parts), 0), scales)]
            layer.weight = new_parameter(torch.cat(rows).clamp(-fq.FP8_MAX, fq.FP8_MAX).to(fq.FP8), WEIGHT)
        layer.weight_scale = new_parameter(top.reshape(()), PER_PART)

    def weight_scale(self, layer: nn.Module) -> torch.Tensor:
        return getattr(layer, self.scheme.scale_name)

    # -- arithmetic ------------------------------------------------------------------------------

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # [M, K]
        if getattr(self, "use_cuda", False):
            from backplane.plugins.quant_fp8.cuda import cuda_linear

            counters = getattr(self, "counters", None)
            if torch.compiler.is_compiling():  # one opaque call (plugins/quant_fp8/opaque.py): Dynamo never traces the launch tables
                y = torch.ops.backplane_fp8.linear(x2, layer.weight, self.weight_scale(layer), self.input_scale(layer),
                                                   bias, counters, self.scheme_key)
            else:
                y = cuda_linear(self.scheme, x2, layer.weight, self.weight_scale(layer), self.input_scale(layer), bias,
                                counters, self.table)
        else:
            y = reference_linear(self.scheme, x2, layer.weight, self.weight_scale(layer), self.input_scale(layer), bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def input_scale(self, layer: nn.Module) -> torch.Tensor | None:
        return layer.input_scale if self.scheme.static_input else None


def _fp8_matmul_device(device: torch.device) -> bool:
    """Whether `device` runs FP8 matmuls (CUDA, compute capability 8.9 or newer); else the reference."""
    if device.type != "cuda":
        return False
    if torch.cuda.get_device_capability(device) < (8, 9):
        logger.warning("quant_fp8: %s has no FP8 matmul (compute capability < 8.9); using the dequantizing "
                       "reference path", torch.cuda.get_device_name(device))
        return False
    return True
