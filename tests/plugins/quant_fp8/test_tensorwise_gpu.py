"""quant_fp8's tensor-wise path on the GPU, bf16 and fp16: cuBLAS's FP8 GEMM (torch._scaled_mm with
scales of 1, fp32 out) and the scale kernel, against the reference and the Triton channel kernel at
decode and prefill sizes (llama-3.1-8b's qkv and down shapes), and replayed inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from backplane.plugins.quant_fp8 import cuda
from backplane.plugins.quant_fp8 import kernels as qk
from backplane.plugins.quant_fp8.reference import reference_linear
from test_decode_kernel_gpu import BF16, CHANNEL, capture, inputs, weights

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, n, k", [(1, 6144, 4096), (8, 4096, 14336), (33, 6144, 4096), (512, 4096, 4096)])
def test_tensorwise_matches_the_reference_and_the_channel_kernel(m, n, k, dtype):
    q_w, s_w = weights(CHANNEL, n, k, seed=m)
    x, bias = inputs(m, k, n, seed=m + 1, dtype=dtype)
    got = cuda.tensorwise(CHANNEL, x, q_w, s_w, None, bias)
    assert got.dtype == dtype and got.shape == (m, n)
    torch.testing.assert_close(got.float(), reference_linear(CHANNEL, x.float(), q_w, s_w, None, bias.float()), **BF16)
    kernel = qk.channel_matmul(x, q_w, s_w, bias, qk.Launch(64, 128, split_k=2))
    torch.testing.assert_close(got, kernel, **BF16)


def test_tensorwise_replays_in_a_graph():
    q_w, s_w = weights(CHANNEL, 6144, 4096, seed=3)
    x, bias = inputs(1, 4096, 6144, seed=4)
    cuda.unit_scale(x.device)  # as Fp8LinearMethod does after loading: before the capture
    eager, graph, out = capture(lambda: cuda.tensorwise(CHANNEL, x, q_w, s_w, None, bias))
    for seed in (11, 12):
        x.copy_(inputs(1, 4096, 6144, seed=seed)[0])
        graph.replay()
        torch.testing.assert_close(out, cuda.tensorwise(CHANNEL, x, q_w, s_w, None, bias), rtol=0, atol=0)
    assert not torch.equal(out, eager)
