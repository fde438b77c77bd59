"""quant_fp8's CUDA paths against the reference path (the same activation quantization, fp32
dequantized matmul): torch._scaled_mm per tensor and row-wise, the Triton block kernel; odd M."""

from __future__ import annotations

import pytest
import torch

from backplane.plugins.quant_fp8 import quantize as fq
from backplane.plugins.quant_fp8.scheme import Fp8Scheme
from backplane.plugins.quant_fp8.cuda import cuda_linear
from backplane.plugins.quant_fp8.reference import reference_linear

pytestmark = pytest.mark.gpu

SCHEMES = {
    "tensor-static": Fp8Scheme(weights="tensor", activations="tensor", static_input=True),
    "tensor-dynamic": Fp8Scheme(weights="tensor", activations="tensor"),
    "channel-token": Fp8Scheme(weights="channel", activations="token"),
    "block": Fp8Scheme(weights="block", activations="group", block=(128, 128), scale_name="weight_scale_inv"),
}


def _weights(scheme: Fp8Scheme, n: int, k: int):
    w = torch.randn(n, k, device="cuda") * 0.05
    if scheme.weights == "tensor":
        q, s = fq.quantize_per_tensor(w)
    elif scheme.weights == "channel":
        q, s = fq.quantize_weight_per_channel(w)
    else:
        q, s = fq.quantize_weight_blocks(w, *scheme.block)
    return q, s


@pytest.mark.parametrize("name", list(SCHEMES))
@pytest.mark.parametrize("m", [1, 17, 256])
@pytest.mark.parametrize("bias", [False, True])
def test_cuda_path_matches_the_reference(name, m, bias):
    torch.manual_seed(m)
    scheme, n, k = SCHEMES[name], 384, 512
    q, s = _weights(scheme, n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
    input_scale = torch.tensor(0.01, device="cuda") if scheme.static_input else None
    got = cuda_linear(scheme, x, q, s, input_scale, b)
    ref = reference_linear(scheme, x.float(), q, s, input_scale, None if b is None else b.float())
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    # bf16 output: within bf16 rounding of the fp32 reference
    torch.testing.assert_close(got.float(), ref, rtol=1.6e-2, atol=1e-2)
    planted = reference_linear(scheme, x.float(), q, s * 1.01, input_scale, None if b is None else b.float())
    assert not torch.allclose(got.float(), planted, rtol=1e-3, atol=1e-3)


def test_cuda_path_replays_in_a_graph():
    scheme = SCHEMES["channel-token"]
    q, s = _weights(scheme, 256, 256)
    x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
    eager = cuda_linear(scheme, x, q, s, None, None)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cuda_linear(scheme, x, q, s, None, None)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, cuda_linear(scheme, x, q, s, None, None))
    assert not torch.equal(out, eager)


def test_online_blocks_on_cuda_equal_the_block_checkpoint(tmp_path):
    """`--fp8.online-block 128x128` on CUDA (the Triton block kernel, graphs on) gives exactly the
    tokens and logprobs of the 128 x 128 block checkpoint written from the same bf16 weights,
    quantized on the same device: the same FP8 bytes and scales through the same kernels."""
    import sys
    from pathlib import Path

    from backplane import Engine, SamplingParams

    sys.path.insert(0, str(Path(__file__).parent))
    from fp8_checkpoints import write_fp8_checkpoint
    from helpers_models import make_hf_model, tiny_hf_config

    config = tiny_hf_config("LlamaForCausalLM", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64)
    hf_model = make_hf_model(config, seed=5).to(torch.bfloat16)  # what the online path quantizes: bf16 weights
    hf_model.save_pretrained(tmp_path / "bf16")
    # NOTE: the checkpoint's blocks are quantized on CUDA, where the online path quantizes the loaded
    # weights: there torch divides amax by 448 as a multiplication by the fp32 reciprocal (a true
    # division on the CPU), so blocks quantized on the CPU have other scales in the last bit (47 of
    # this model's 72) and other FP8 bytes (658 of 1.18M).
    write_fp8_checkpoint(hf_model.to("cuda"), tmp_path / "block", "block", block=(128, 128))
    kw = dict(device="cuda", dtype="bfloat16", attention_backend="triton", max_total_tokens=1024, cuda_graph_bs=[1, 2])
    prompts = [[5, 17, 33, 2, 9, 120, 44], [7, 8, 9, 10]]
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    outs = {}
    for name, extra in (("online", dict(quantization="fp8", plugin_options={"fp8": {"online_block": "128x128"}})),
                        ("checkpoint", {})):
        engine = Engine(str(tmp_path / ("bf16" if name == "online" else "block")), **kw, **extra)
        try:
            outs[name] = engine.generate(input_ids=prompts, sampling_params=params)
        finally:
            engine.shutdown()
    for got, want in zip(outs["online"], outs["checkpoint"]):
        assert got.error is None and got.token_ids == want.token_ids
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), rtol=0, atol=1e-6)
