"""transformers loading the FP8 checkpoints the engine loads (fp8_checkpoints.py writes them), and
the comparison of the engine with those models.

- compressed-tensors ("channel", "tensor"): `load_compressed_tensors`, transformers with the
  compressed-tensors package. Its default route keeps each quantized linear's FP8 weight and scales
  as the file has them, decompresses the weight at the first forward and quantizes the linear's
  input as the checkpoint's `input_activations` say (per token, or with the static input_scale), so
  on CPU it computes what quant_fp8 computes.
- block-wise "fp8": transformers' FineGrainedFP8 integration. On CUDA its FP8Linear modules keep the
  FP8 weights and `weight_scale_inv` blocks and run an FP8 kernel that quantizes the input per 1 x bk
  group (`load_block_fp8`; the kernel comes from the Hugging Face Hub through the `kernels` package).
  Without a GPU, or asked to, transformers dequantizes the weights while loading
  (`load_block_dequantized`, which adds the 1 x bk input quantization the kernel does).

`compare` checks the engine against one of them: greedy tokens equal apart from near-ties of an fp32
reference, and the logits of every prompt position close (`LogitRule`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from backplane.plugins.quant_fp8 import quantize as fq
from helpers_models import forward_logits


def quantized_modules(path: Path, scale_name: str) -> list[str]:
    """The modules of the checkpoint at `path` that have a `scale_name` tensor (its FP8 linears)."""
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return sorted(n[: -len(scale_name) - 1] for n in f.keys() if n.endswith("." + scale_name))


def load_compressed_tensors(path: Path):
    """transformers' fp32 model of a compressed-tensors FP8 checkpoint, through the compressed-tensors
    package (its default route: FP8 weights as stored, inputs quantized as the config says)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def load_block_dequantized(path: Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """transformers' model of a block-wise FP8 checkpoint on `device` with the weights dequantized to
    `dtype` while loading (what FineGrainedFP8 does without a GPU, asked for explicitly so it does so
    on any machine), every FP8 linear's input quantized per 1 x bk group as the FP8 kernel quantizes it."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    config = FineGrainedFP8Config(dequantize=True, weight_block_size=qc["weight_block_size"],
                                  modules_to_not_convert=qc["modules_to_not_convert"])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device, attn_implementation="eager",
                                                 quantization_config=config).eval()
    group = qc["weight_block_size"][1]
    return quantize_inputs(model, quantized_modules(path, "weight_scale_inv"), lambda x: _group_fake_quant(x, group))


def load_block_fp8(path: Path, dtype: torch.dtype, device: str):
    """(model, loading info) of transformers' FineGrainedFP8 integration keeping the checkpoint's FP8
    weights in FP8Linear modules on `device` (on CUDA their forward is transformers' FP8 kernel)."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device,
                                                       attn_implementation="eager", output_loading_info=True)
    return model.eval(), info


def _group_fake_quant(x: torch.Tensor, group: int) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])  # [tokens, K]
    return fq.dequantize_groups(*fq.quantize_per_group(rows, group)).reshape(x.shape).to(x.dtype)


def quantize_inputs(model, modules: list[str], fake_quant: Callable[[torch.Tensor], torch.Tensor]):
    """`model` with the input of each of `modules` replaced by `fake_quant(input)`."""
    for name in modules:
        model.get_submodule(name).register_forward_pre_hook(lambda _m, args: (fake_quant(args[0]),))
    return model


@torch.no_grad()
def greedy(model, prompt: list[int], steps: int) -> list[int]:
    """`steps` greedy tokens of a transformers model after `prompt`."""
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(logits(model, ids)[-1].argmax()))
    return ids[len(prompt):]


@torch.no_grad()
def logits(model, ids: list[int]) -> torch.Tensor:
    """fp32 logits [len(ids), vocab] (on the CPU) of a transformers model."""
    device = next(model.parameters()).device
    return model(torch.tensor([ids], device=device)).logits[0].float().cpu()


@torch.no_grad()
def engine_prefill_logits(engine, prompts: list[list[int]]) -> list[torch.Tensor]:
    """The engine's fp32 logits of every position of each prompt ([len(prompt), vocab] each), from
    one prefill batch of all of them."""
    prefill, _ = forward_logits(engine, prompts)
    return list(prefill.split([len(p) for p in prompts]))


@dataclass(frozen=True)
class LogitRule:
    """How close the engine's prompt logits must be to the other model's, in units of that model's
    logits' standard deviation at the position: every position within `most`, and at least the share
    `exact_share` of them within `exact` (sums in another order; a few positions may have one FP8
    rounding of an activation flipped by that rounding noise)."""

    exact: float
    most: float
    exact_share: float


@dataclass(frozen=True)
class Comparison:
    """The engine against transformers: `problems` (empty when they match), the near-ties the tokens
    diverged at (request, position, margin / std), and the largest prompt logit difference / std."""

    problems: list[str]
    ties: list[tuple[int, int, float]]
    worst_logit_error: float | None


def compare(prompts, engine_tokens, hf_tokens, reference: Callable[[list[int]], torch.Tensor], tie_fraction: float,
            engine_logits=None, hf_logits=None, rule: LogitRule | None = None) -> Comparison:
    """Greedy tokens equal apart from near-ties: at a request's first differing token, `reference`'s
    fp32 logits (of the prompt and transformers' tokens before it) prefer transformers' token to the
    engine's, or the other way round, by at most `tie_fraction` of their std. With `rule`, the
    engine's prompt logits [len(prompt), vocab] against transformers' too."""
    problems, ties = [], []
    for i, (prompt, got, want) in enumerate(zip(prompts, engine_tokens, hf_tokens)):
        if len(got) != len(want):
            problems.append(f"request {i}: {len(got)} tokens, transformers {len(want)}")
        j = next((p for p, (g, w) in enumerate(zip(got, want)) if g != w), None)
        if j is None:
            continue
        row = reference(list(prompt) + list(want[:j]))
        margin = float((row[want[j]] - row[got[j]]).abs() / row.std())
        ties.append((i, j, margin))
        if margin > tie_fraction:
            problems.append(f"request {i} token {j}: {got[j]}, transformers {want[j]}: a margin of {margin:.4f} "
                            f"of the fp32 logits' std, the tie limit {tie_fraction}")
    if rule is None:
        return Comparison(problems, ties, None)
    errors = torch.cat([(e - h).abs().amax(-1) / h.std(-1) for e, h in zip(engine_logits, hf_logits)])
    exact_share = float((errors <= rule.exact).float().mean())
    if errors.max() > rule.most or exact_share < rule.exact_share:
        problems.append(f"prompt logits: the largest difference {float(errors.max()):.3g} of the std (at most "
                        f"{rule.most}), {exact_share:.0%} of positions within {rule.exact} (at least "
                        f"{rule.exact_share:.0%})")
    return Comparison(problems, ties, float(errors.max()))


def block_layout_problems(path: Path) -> list[str]:
    """What transformers' FineGrainedFP8 integration finds wrong when it loads the block-wise FP8
    checkpoint at `path` as on a GPU (FP8Linear modules keeping the FP8 weights), here on the CPU:
    its loading report (missing, unexpected, mismatched tensors), the FP8Linear modules against the
    checkpoint's FP8 linears, their block size, and every FP8 tensor against the file's, bit for bit.

    NOTE: FineGrainedFP8HfQuantizer.validate_environment is skipped: without a GPU it would switch
    to dequantizing while loading, which is all it decides; the modules and the loading of the
    tensors into them are those of the GPU."""
    from unittest import mock

    from safetensors.torch import load_file
    from transformers.integrations.finegrained_fp8 import FP8Linear
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    with mock.patch.object(FineGrainedFP8HfQuantizer, "validate_environment", lambda self, *args, **kwargs: None):
        try:
            model, info = load_block_fp8(path, torch.bfloat16, "cpu")
        except RuntimeError as err:  # a tensor of another shape than the module's
            return [f"loading: {str(err).splitlines()[0]}"]
    problems = [f"{kind}: {sorted(names)}" for kind, names in info.items() if names]
    fp8 = {name: m for name, m in model.named_modules() if isinstance(m, FP8Linear)}
    expected = quantized_modules(path, "weight_scale_inv")
    if sorted(fp8) != expected:
        problems.append(f"FP8Linear modules {sorted(fp8)}, the checkpoint's FP8 linears {expected}")
    block = json.loads((path / "config.json").read_text())["quantization_config"]["weight_block_size"]
    file = load_file(str(path / "model.safetensors"))
    for name, module in fp8.items():
        if list(module.block_size) != block:
            problems.append(f"{name}: block size {module.block_size}, the checkpoint's {block}")
        for tensor in ("weight", "weight_scale_inv"):
            got, want = getattr(module, tensor).detach(), file.get(f"{name}.{tensor}")
            if want is None or got.dtype != want.dtype or not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
                problems.append(f"{name}.{tensor}: transformers holds another tensor than the checkpoint's")
    return problems
