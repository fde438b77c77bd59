"""Quantization method "fp8": FP8 (e4m3) weights with their scales, FP8 activations.

Loads compressed-tensors FP8 checkpoints (per-channel or per-tensor weight scales; dynamic
per-token or static per-tensor activation scales; block scales), the block-wise "fp8" format of
Qwen3-FP8 and DeepSeek (128x128 weight blocks, `weight_scale_inv`, dynamic 1x128 activation groups)
and its per-tensor variant, Meta's "fbgemm_fp8" (per-channel scales, per-token activations whose
scale is bounded by activation_scale_ub), NVIDIA ModelOpt's "modelopt" with quant_algo FP8
(per-tensor weight and static input scales; also from an hf_quant_config.json beside config.json,
which the core reads), and quantizes a bf16 checkpoint online (`--quantization fp8`: per-channel
weight scales, dynamic per-token activations; with `--fp8.online-block 128x128`, block scales and
1 x 128 activation groups as the block-wise checkpoints have them).

On CPU (and on a GPU without FP8 matmuls) the reference path runs: activations quantized exactly as
on the GPU, then dequantized and multiplied in fp32. On CUDA: torch._scaled_mm for per-tensor and
row-wise scales, a Triton kernel for block scales. This module only registers; torch is imported
when the method is built.
"""

from __future__ import annotations

from backplane import hookimpl

from backplane import QuantMethodSpec

NAME = "fp8"
FORMATS = ("compressed-tensors", "fp8", "fbgemm_fp8", "modelopt")


def _available() -> str | None:
    import torch

    if not hasattr(torch, "float8_e4m3fn"):
        return f"torch {torch.__version__} has no float8_e4m3fn dtype (expected torch >= 2.1)"
    return None


def _factory(ctx):
    from backplane.plugins.quant_fp8.config import make_config

    return make_config(ctx)


@hookimpl
def backplane_register_quant_methods(register):
    register(QuantMethodSpec(
        name=NAME, factory=_factory,
        description="FP8 e4m3 weights and activations: compressed-tensors, block-wise fp8, fbgemm_fp8, ModelOpt, online",
        checkpoint_formats=FORMATS, supports_online=True,
        # LoRA: adapters in the model dtype over the FP8 base (backplane.lora.layers); the folded
        # decode path is declined for a quantized base, the unfolded LoRA kernels run instead.
        supports_lora=True, supports_tp=True, supports_graph=True, supports_compile=True,
        priority=10, available=_available, install_hint="pip install 'torch>=2.1'",
    ))


@hookimpl
def backplane_register_settings(register):
    from backplane.plugins.quant_fp8.options import Fp8Options

    register(NAME, Fp8Options)


@hookimpl
def backplane_configure(settings):
    """--fp8.online-block only means something when this method quantizes online: refuse it otherwise."""
    options = settings.options_for(NAME)
    if options is None or options.online_block is None:
        return
    if settings.quantization.split("@")[0] != NAME:
        raise ValueError(f"--fp8.online-block {options.online_block}: applies to --quantization fp8 (a bf16 checkpoint "
                         f"quantized online); got --quantization {settings.quantization}")
