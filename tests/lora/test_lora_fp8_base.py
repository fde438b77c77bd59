"""LoRA adapters (in the model dtype) over an FP8 base: a tiny Llama quantized online
(`quantization="fp8"`: per-channel weight scales, dynamic per-token activations) with PEFT adapters.

The reference is an unquantized engine whose projection weights are the dequantized FP8 ones and whose
base layers see their input quantized per token the same way (a forward pre-hook on each base layer,
so the LoRA delta still reads the unquantized activations, as over the FP8 base), running the same
adapters with the torch_native backend. Both LoRA backends over the FP8 base (triton interpreted on
CPU, fp32) must generate what it does, in a batch mixing adapter and base-only requests; the triton
backend's folded decode path is declined for the quantized base, and its summary says so.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from backplane import Engine, SamplingParams
from lora_helpers import ADAPTERS, forward_requests, make_lora_world

PROMPTS = [[5, 17, 33, 2, 9, 120, 44], [7, 8, 61], [40, 41, 42, 43], [5, 17, 33, 2, 9, 120, 44]]
MIXED = ["all7_r4", None, "qv_down_r8", None]  # prompts 0 and 3 are the same: adapter against base
GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
ENGINE = dict(device="cpu", dtype="float32", max_total_tokens=512, max_running_requests=4, max_loras_per_batch=2)
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    adapters = {name: ADAPTERS[name] for name in ("all7_r4", "qv_down_r8")}
    return make_lora_world(tmp_path_factory.mktemp("lora-fp8"), adapters)


def write_dequantized_base(base_dir, out_dir):
    """The base checkpoint with each decoder projection weight replaced by its online FP8 quantization,
    dequantized (per-channel scales, as `--quantization fp8` makes them), in fp32."""
    from safetensors.torch import load_file, save_file

    from backplane.plugins.quant_fp8 import quantize as fq

    shutil.copytree(base_dir, out_dir)
    path = out_dir / "model.safetensors"
    tensors = load_file(str(path))
    changed = 0
    for name, tensor in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in PROJ:
            q, scale = fq.quantize_weight_per_channel(tensor.float())
            tensors[name] = fq.dequantize_weight(q, scale).to(tensor.dtype).contiguous()
            changed += 1
    assert changed > 0
    save_file(tensors, str(path), metadata={"format": "pt"})
    assert "quantization_config" not in json.loads((out_dir / "config.json").read_text())


def quantize_base_inputs(engine) -> int:
    """Make every LoRA layer's base layer see its input as the FP8 matmul does (per-token FP8, then
    dequantized); the LoRA delta keeps the unquantized input."""
    from backplane.plugins.quant_fp8 import quantize as fq

    def pre_hook(module, args):
        x = args[0]
        q, scale = fq.quantize_per_token(x.reshape(-1, x.shape[-1]))
        return ((q.float() * scale).to(x.dtype).reshape(x.shape),)

    for layer in engine.lora_manager.layers:
        layer.base_layer.register_forward_pre_hook(pre_hook)
    return len(engine.lora_manager.layers)


@pytest.fixture(scope="module")
def reference(world, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("lora-fp8-ref") / "dequantized"
    write_dequantized_base(world.base_dir, out_dir)
    engine = Engine(str(out_dir), **ENGINE, lora_paths=world.lora_paths(), lora_backend="torch_native")
    assert quantize_base_inputs(engine) > 0
    assert engine.backends["lora"]["decode_path"].startswith("unfolded")
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def fp8_engine(world):
    engine = Engine(str(world.base_dir), **ENGINE, quantization="fp8", lora_paths=world.lora_paths(),
                    lora_backend="torch_native")
    yield engine
    engine.shutdown()


def assert_same_generation(got, want):
    for g, w in zip(got, want):
        assert g.error is None and w.error is None
        assert g.token_ids == w.token_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-4, rtol=1e-4)


def test_the_lora_layers_run_in_the_model_dtype_over_fp8_weights(fp8_engine):
    layers = fp8_engine.lora_manager.layers
    assert layers
    for layer in layers:
        assert layer.base_layer.quant_method is not None
        assert layer.base_layer.weight.dtype == torch.float8_e4m3fn
        assert layer.lora_a.dtype == layer.lora_b.dtype == torch.float32
        assert layer.lora_a.shape[2] == layer.base_layer.input_size_per_partition


def test_torch_native_over_fp8_equals_the_dequantized_reference(fp8_engine, reference):
    got = fp8_engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, lora=MIXED)
    want = reference.generate(input_ids=PROMPTS, sampling_params=GREEDY, lora=MIXED)
    assert_same_generation(got, want)
    # the adapter visibly changes the output: the same prompt with and without it
    assert got[0].token_ids != got[3].token_ids or \
        abs(got[0].logprobs[0] - got[3].logprobs[0]) > 1e-2


def test_mixed_forward_logits_equal_the_reference(fp8_engine, reference):
    """One mixed prefill and decode step: every token's logits, adapter and base-only rows alike."""
    next_tokens = [11, 12, 13, 14]
    got_prefill, got_decode = forward_requests(fp8_engine, PROMPTS, MIXED, next_tokens)
    want_prefill, want_decode = forward_requests(reference, PROMPTS, MIXED, next_tokens)
    torch.testing.assert_close(got_prefill, want_prefill, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_decode, want_decode, atol=1e-4, rtol=1e-4)
    first, last = 0, len(PROMPTS[0]) + len(PROMPTS[1]) + len(PROMPTS[2])  # prompt 0 (adapter), prompt 3 (base)
    delta = (got_prefill[first : first + 7] - got_prefill[last : last + 7]).abs().max()
    assert delta > 0.05, f"the adapter barely changes the logits ({delta})"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU run of Triton needs TRITON_INTERPRET=1")
def test_triton_over_fp8_declines_the_folded_path_and_equals_the_reference(world, reference):
    engine = Engine(str(world.base_dir), **ENGINE, quantization="fp8", lora_paths=world.lora_paths(),
                    lora_backend="triton")
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
    write_dequantized_base(world.base_dir, ref_dir)
    next_tokens = [11, 12, 13, 14]
    results = {}
    for name, path, kwargs in (("reference", ref_dir, {}),
                               ("torch_native", world.base_dir, {"quantization": "fp8"}),
                               ("triton", world.base_dir, {"quantization": "fp8"})):
        backend = "torch_native" if name == "reference" else name
        engine = gpu_engine(path, backend, lora_paths=world.lora_paths(), **kwargs)
        try:
            if name == "reference":
                quantize_base_inputs(engine)
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
    last = len(PROMPTS[0]) + len(PROMPTS[1]) + len(PROMPTS[2])
    assert (tn_prefill[:7] - tn_prefill[last : last + 7]).abs().max() > 0.05
