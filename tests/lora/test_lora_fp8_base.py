"""LoRA adapters (in the model dtype) over an FP8 base: a tiny Llama quantized online
(`quantization="fp8"`: per-channel weight scales, dynamic per-token activations) or written as an FP8
checkpoint (compressed-tensors per-channel and per-tensor, block-wise fp8), with PEFT adapters.

The reference is an unquantized engine whose projection weights are the dequantized FP8 ones and whose
base layers see their input quantized the same way (a forward pre-hook on each base layer, so the
LoRA delta still reads the unquantized activations, as over the FP8 base), running the same adapters
with the torch_native backend. Both LoRA backends over the FP8 base (triton interpreted on CPU,
fp32) must generate what it does, in a batch mixing adapter and base-only requests; the triton
backend's folded decode path is declined for the quantized base, and its summary says so.
The `gpu` test runs both backends in bf16 over online FP8 (torch._scaled_mm) with CUDA graphs.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from backplane import Engine, SamplingParams
from lora_helpers import ADAPTERS, forward_requests, make_lora_world

sys.path.insert(0, str(Path(__file__).parents[1] / "plugins" / "quant_fp8"))
from fp8_checkpoints import _quantize_input, write_fp8_checkpoint  # noqa: E402

PROMPTS = [[5, 17, 33, 2, 9, 120, 44], [7, 8, 61], [40, 41, 42, 43], [5, 17, 33, 2, 9, 120, 44]]
MIXED = ["all7_r4", None, "qv_down_r8", None]  # prompts 0 and 3 are the same: adapter against base
GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
ENGINE = dict(device="cpu", dtype="float32", max_total_tokens=512, max_running_requests=4, max_loras_per_batch=2)
FORMATS = ("online", "channel", "tensor", "block")  # online: per-channel weights, per-token activations


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    adapters = {name: ADAPTERS[name] for name in ("all7_r4", "qv_down_r8")}
    return make_lora_world(tmp_path_factory.mktemp("lora-fp8"), adapters)


class Fp8World:
    """For one format: the path the FP8 engine loads (with its kwargs) and the reference checkpoint
    (the base with each projection's dequantized FP8 weight)."""

    def __init__(self, world, fmt: str, root: Path):
        self.fmt = fmt
        if fmt == "online":  # what --quantization fp8 makes: per-channel scales of the checkpoint's weights
            self.path, self.kwargs = world.base_dir, {"quantization": "fp8"}
            dequant = per_channel_dequantized(world)
        else:
            self.path, self.kwargs = root / "fp8", {}
            dequant = write_fp8_checkpoint(world.merged[None], self.path, fmt)
        self.reference_dir = root / "dequantized"
        write_dequantized_base(world.base_dir, self.reference_dir, dequant)

    @property
    def activations(self) -> str:
        """The activation quantization of fp8_checkpoints' format (online: per token, as "channel")."""
        return "channel" if self.fmt == "online" else self.fmt


def per_channel_dequantized(world) -> dict[str, torch.Tensor]:
    """What --quantization fp8 makes of each decoder projection of the base, dequantized (fp32)."""
    from backplane.plugins.quant_fp8 import quantize as fq

    dequant = {}
    for name, module in world.merged[None].named_modules():
        if name.split(".")[-1].endswith("_proj") and ".layers." in name:
            q, scale = fq.quantize_weight_per_channel(module.weight.detach().float())
            dequant[name] = fq.dequantize_weight(q, scale)
    return dequant


def write_dequantized_base(base_dir: Path, out_dir: Path, dequant: dict[str, torch.Tensor]) -> None:
    """The base checkpoint with each decoder projection weight replaced by `dequant[module name]`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(base_dir, out_dir)
    path = out_dir / "model.safetensors"
    tensors = load_file(str(path))
    assert dequant and all(f"{name}.weight" in tensors for name in dequant)
    for name, weight in dequant.items():
        tensors[f"{name}.weight"] = weight.to(tensors[f"{name}.weight"].dtype).contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})


def quantize_base_inputs(engine, fmt: str) -> int:
    """Make every LoRA layer's base layer see its input as the FP8 matmul does (quantized as
    fp8_checkpoints' format `fmt`, then dequantized); the LoRA delta keeps the unquantized input."""
    for layer in engine.lora_manager.layers:
        layer.base_layer.register_forward_pre_hook(lambda _m, args: (_quantize_input(fmt, args[0]),))
    return len(engine.lora_manager.layers)


@pytest.fixture(scope="module", params=FORMATS)
def fp8(request, world, tmp_path_factory):
    """(Fp8World, the FP8 engine with torch_native LoRA, the reference engine) of one format."""
    fmt = request.param
    made = Fp8World(world, fmt, tmp_path_factory.mktemp(f"lora-fp8-{fmt}"))
    engine = Engine(str(made.path), **ENGINE, **made.kwargs, lora_paths=world.lora_paths(), lora_backend="torch_native")
    reference = Engine(str(made.reference_dir), **ENGINE, lora_paths=world.lora_paths(), lora_backend="torch_native")
    assert quantize_base_inputs(reference, made.activations) > 0
    yield made, engine, reference
    engine.shutdown()
    reference.shutdown()


def assert_same_generation(got, want):
    for g, w in zip(got, want):
        assert g.error is None and w.error is None
        assert g.token_ids == w.token_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-4, rtol=1e-4)


def test_the_lora_layers_run_in_the_model_dtype_over_fp8_weights(fp8):
    _, engine, reference = fp8
    layers = engine.lora_manager.layers
    assert layers
    for layer in layers:
        assert layer.base_layer.quant_method is not None
        assert layer.base_layer.weight.dtype == torch.float8_e4m3fn
        assert layer.lora_a.dtype == layer.lora_b.dtype == torch.float32
        assert layer.lora_a.shape[2] == layer.base_layer.input_size_per_partition
    assert all(layer.base_layer.quant_method is None for layer in reference.lora_manager.layers)
    assert engine.backends["lora"]["decode_path"].startswith("unfolded")  # torch_native never folds


def test_torch_native_over_fp8_equals_the_dequantized_reference(fp8):
    _, engine, reference = fp8
    got = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, lora=MIXED)
    want = reference.generate(input_ids=PROMPTS, sampling_params=GREEDY, lora=MIXED)
    assert_same_generation(got, want)


def test_mixed_forward_logits_equal_the_reference(fp8):
    """One mixed prefill and decode step: every token's logits, adapter and base-only rows alike; the
    adapter visibly changes them (prompt 0 with it against the same prompt 3 without)."""
    _, engine, reference = fp8
    next_tokens = [11, 12, 13, 14]
    got_prefill, got_decode = forward_requests(engine, PROMPTS, MIXED, next_tokens)
    want_prefill, want_decode = forward_requests(reference, PROMPTS, MIXED, next_tokens)
    torch.testing.assert_close(got_prefill, want_prefill, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_decode, want_decode, atol=1e-4, rtol=1e-4)
    n, last = len(PROMPTS[0]), sum(len(p) for p in PROMPTS[:3])
    delta = (got_prefill[:n] - got_prefill[last : last + n]).abs().max()
    assert delta > 0.05, f"the adapter barely changes the logits ({delta})"
    assert (got_decode[0] - got_decode[3]).abs().max() > 0.05


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU run of Triton needs TRITON_INTERPRET=1")
def test_triton_over_fp8_declines_the_folded_path_and_equals_the_reference(world, fp8):
    made, _, reference = fp8
    engine = Engine(str(made.path), **ENGINE, **made.kwargs, lora_paths=world.lora_paths(), lora_backend="triton")
    try:
        summary = engine.backends["lora"]
        assert summary["backend"] == "triton"
        assert engine.lora_manager.backend.folds_shrink  # the default decode path is folded...
        assert "declined" in summary["decode_path"] and "quantized" in summary["decode_path"]
        assert all(layer.w_ext is None and layer.fold_declined for layer in engine.lora_manager.layers)
        got = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, lora=MIXED)
    finally:
        engine.shutdown()
    want = reference.generate(input_ids=PROMPTS, sampling_params=GREEDY, lora=MIXED)
    assert_same_generation(got, want)


def gpu_engine(path, backend: str, **kwargs) -> Engine:
    return Engine(str(path), device="cuda", dtype="bfloat16", max_total_tokens=2048, max_running_requests=4,
                  max_loras_per_batch=2, lora_backend=backend, cuda_graph_bs=[1, 2, 4], **kwargs)


@pytest.mark.gpu
def test_gpu_both_backends_over_fp8_in_bf16(world, tmp_path):
    """bf16 on the GPU (FP8 base through torch._scaled_mm, CUDA graphs for decode): torch_native and
    triton (its folded path declined) give the same mixed-batch logits within bf16 rounding, both
    within FP8-and-bf16 rounding of the dequantized reference, and the same greedy tokens; the
    adapter changes the output."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    ref_dir = tmp_path / "dequantized"
    write_dequantized_base(world.base_dir, ref_dir, per_channel_dequantized(world))
    next_tokens = [11, 12, 13, 14]
    results = {}
    for name, path, kwargs in (("reference", ref_dir, {}),
                               ("torch_native", world.base_dir, {"quantization": "fp8"}),
                               ("triton", world.base_dir, {"quantization": "fp8"})):
        backend = "torch_native" if name == "reference" else name
        engine = gpu_engine(path, backend, lora_paths=world.lora_paths(), **kwargs)
        try:
            if name == "reference":
                quantize_base_inputs(engine, "channel")
            else:
                assert all(layer.base_layer.weight.dtype == torch.float8_e4m3fn for layer in engine.lora_manager.layers)
                assert all(layer.lora_b.dtype == torch.bfloat16 for layer in engine.lora_manager.layers)
            if name == "triton":
                assert "declined" in engine.backends["lora"]["decode_path"]
            logits = forward_requests(engine, PROMPTS, MIXED, next_tokens)
            outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, lora=MIXED)
            results[name] = logits, [o.token_ids for o in outs]
        finally:
            engine.shutdown()
            torch.cuda.empty_cache()
    (tn_prefill, tn_decode), tn_tokens = results["torch_native"]
    (tr_prefill, tr_decode), tr_tokens = results["triton"]
    (ref_prefill, ref_decode), _ = results["reference"]
    torch.testing.assert_close(tr_prefill, tn_prefill, atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(tr_decode, tn_decode, atol=3e-2, rtol=2e-2)
    for got in (tn_prefill, tr_prefill):
        torch.testing.assert_close(got, ref_prefill, atol=1e-1, rtol=5e-2)
    assert tr_tokens == tn_tokens
    n, last = len(PROMPTS[0]), sum(len(p) for p in PROMPTS[:3])
    assert (tn_prefill[:n] - tn_prefill[last : last + n]).abs().max() > 0.05
