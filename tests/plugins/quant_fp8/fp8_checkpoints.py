"""Writing FP8 checkpoints of a tiny bf16/fp32 model, as llm-compressor or a block-wise FP8 release
would, and the reference model of each: transformers' model with the dequantized weights and every
linear's input quantized and dequantized the same way.

Formats: "channel" (compressed-tensors, per-channel weight scales, dynamic per-token activations),
"tensor" (compressed-tensors, per-tensor weight scales shared by a fused group, static input_scale),
"block" (quant_method "fp8": weight_scale_inv blocks, dynamic 1 x bk activation groups).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from backplane.contracts.quant import module_matches
from backplane.plugins.quant_fp8 import quantize as fq

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
INPUT_SCALE = 0.02  # static activation scale of the "tensor" format: |x| up to about 9 is represented
BLOCK = (16, 16)


def _linear_names(state: dict[str, torch.Tensor]) -> list[str]:
    return [n[: -len(".weight")] for n in state if n.endswith(".weight") and n.split(".")[-2] in PROJ]


def _group_of(module: str) -> str:
    layer, proj = module.rsplit(".", 1)
    return f"{layer.rsplit('.', 1)[0]}.{FUSED.get(proj, proj)}"


def quantized_state(state: dict[str, torch.Tensor], fmt: str, ignore: tuple[str, ...] = (),
                    block: tuple[int, int] = BLOCK):
    """(checkpoint tensors, dequantized fp32 weights by module name) of `state` in format `fmt`
    (`block`: the weight blocks of fmt "block")."""
    out = {n: t.clone() for n, t in state.items()}
    dequant: dict[str, torch.Tensor] = {}
    modules = [m for m in _linear_names(state) if not any(module_matches(m, p) for p in ignore)]
    group_max = {}
    for m in modules:  # "tensor": one scale per fused group (what a fused layer keeps)
        g = _group_of(m)
        group_max[g] = max(group_max.get(g, 0.0), float(state[m + ".weight"].abs().max()))
    for m in modules:
        w = state[m + ".weight"].float()
        if fmt == "channel":
            q, scale = fq.quantize_weight_per_channel(w)
            out[m + ".weight_scale"] = scale
        elif fmt == "tensor":
            q, scale = fq.quantize_per_tensor(w, torch.tensor(group_max[_group_of(m)] / fq.FP8_MAX))
            out[m + ".weight_scale"] = scale.reshape(1)
            out[m + ".input_scale"] = torch.tensor([INPUT_SCALE])
        else:
            q, scale = fq.quantize_weight_blocks(w, *block)
            out[m + ".weight_scale_inv"] = scale
        out[m + ".weight"] = q
        dequant[m] = fq.dequantize_weight(q, scale, block if fmt == "block" else None)
    return out, dequant


def quantization_config(fmt: str, ignore: tuple[str, ...] = (), block: tuple[int, int] = BLOCK) -> dict:
    if fmt == "block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": list(block), "modules_to_not_convert": ["lm_head", *ignore]}
    weights = {"num_bits": 8, "type": "float", "strategy": fmt, "dynamic": False, "symmetric": True}
    acts = {"num_bits": 8, "type": "float", "symmetric": True,
            **({"strategy": "token", "dynamic": True} if fmt == "channel" else {"strategy": "tensor", "dynamic": False})}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
            "ignore": ["lm_head", *ignore]}


def write_fp8_checkpoint(hf_model, path: Path, fmt: str, ignore: tuple[str, ...] = (),
                         block: tuple[int, int] = BLOCK) -> dict[str, torch.Tensor]:
    """Save `hf_model` quantized in `fmt` under `path` (config.json with quantization_config,
    model.safetensors); returns the dequantized weights by module name. `block`: the weight blocks
    of fmt "block" (the CUDA kernels need at least 32 columns; BLOCK is small for CPU tests)."""
    path.mkdir(parents=True, exist_ok=True)
    hf_model.config.save_pretrained(path)
    state = {n: t.detach().contiguous() for n, t in hf_model.state_dict().items()}
    tensors, dequant = quantized_state(state, fmt, ignore, block)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt, ignore, block)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return dequant


def _quantize_input(fmt: str, x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    if fmt == "channel":
        q, s = fq.quantize_per_token(x2)
        y = q.float() * s
    elif fmt == "tensor":
        q, s = fq.quantize_per_tensor(x2, torch.tensor(INPUT_SCALE))
        y = q.float() * s
    else:
        q, s = fq.quantize_per_group(x2, BLOCK[1])
        y = fq.dequantize_groups(q, s)
    return y.reshape(x.shape).to(x.dtype)


def reference_model(hf_model, dequant: dict[str, torch.Tensor], fmt: str):
    """A copy of `hf_model` with the dequantized weights whose quantized linears see their input
    quantized and dequantized as quant_fp8 does."""
    ref = copy.deepcopy(hf_model)
    modules = dict(ref.named_modules())
    for name, w in dequant.items():
        linear = modules[name]
        with torch.no_grad():
            linear.weight.copy_(w)
        linear.register_forward_pre_hook(lambda _m, args: (_quantize_input(fmt, args[0]),))
    return ref
