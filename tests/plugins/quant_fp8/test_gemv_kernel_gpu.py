"""quant_fp8's GEMV launches on the GPU, bf16 x: channel_matmul and block_matmul against the tl.dot
launches and the reference at M 1 to 8 (Llama-8B shapes and tails, split K, x quantized inside the
GEMV or before it), and a GEMV launch captured in a CUDA graph and replayed with new inputs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from backplane.plugins.quant_fp8 import kernels as qk
from backplane.plugins.quant_fp8.reference import reference_linear
from test_decode_kernel_gpu import BF16, BLOCKWISE, CHANNEL, capture, inputs, weights

pytestmark = pytest.mark.gpu

GEMVS = [qk.Launch(32, 256, split_k=2, num_warps=4, num_stages=2, fuse_quant=True, gemv=True),
         qk.Launch(16, 512, split_k=4, num_warps=8, num_stages=3, fuse_quant=True, gemv=True),
         qk.Launch(64, 128, split_k=1, num_warps=4, num_stages=1, gemv=True),
         qk.Launch(128, 256, split_k=3, num_warps=8, num_stages=2, gemv=True)]


@pytest.mark.parametrize("launch", GEMVS, ids=str)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("n, k", [(6144, 4096), (1000, 1040)])
def test_gemv_and_dot_launches_agree(n, k, m, launch):
    q_w, s_w = weights(CHANNEL, n, k, seed=m)
    x, bias = inputs(m, k, n, seed=m + 1)
    counters = qk.new_counters(q_w)
    got = qk.channel_matmul(x, q_w, s_w, bias, launch, counters)
    assert got.dtype == torch.bfloat16 and counters.abs().sum() == 0
    dot = qk.channel_matmul(x, q_w, s_w, bias, dataclasses.replace(launch, gemv=False), counters)
    torch.testing.assert_close(got, dot, **BF16)
    ref = reference_linear(CHANNEL, x.float(), q_w, s_w, None, bias.float())
    torch.testing.assert_close(got.float(), ref, **BF16)
    assert not torch.allclose(got.float(), reference_linear(CHANNEL, x.float(), q_w, s_w * 1.01, None, bias.float()),
                              rtol=1e-3, atol=1e-3)
    if k % 128 == 0:
        q_b, s_b = weights(BLOCKWISE, n, k, seed=m + 2)
        got = qk.block_matmul(x, q_b, s_b, BLOCKWISE.block, bias, launch, counters)
        dot = qk.block_matmul(x, q_b, s_b, BLOCKWISE.block, bias, dataclasses.replace(launch, gemv=False), counters)
        torch.testing.assert_close(got, dot, **BF16)
        ref = reference_linear(BLOCKWISE, x.float(), q_b, s_b, None, bias.float())
        torch.testing.assert_close(got.float(), ref, **BF16)


@pytest.mark.parametrize("kernel", ["channel", "block"])
@pytest.mark.parametrize("m", [1, 8])
def test_a_gemv_launch_replays_in_a_graph(kernel, m):
    n, k = 4096, 14336
    scheme = BLOCKWISE if kernel == "block" else CHANNEL
    q_w, s_w = weights(scheme, n, k, seed=m)
    x, bias = inputs(m, k, n, seed=m)
    counters = qk.new_counters(q_w)
    launch = qk.Launch(32, 128 if kernel == "block" else 256, split_k=4, num_stages=2, fuse_quant=True, gemv=True)

    def run():
        if kernel == "block":
            return qk.block_matmul(x, q_w, s_w, scheme.block, bias, launch, counters)
        return qk.channel_matmul(x, q_w, s_w, bias, launch, counters)

    eager, graph, out = capture(run)
    for seed in (11, 12):
        x.copy_(inputs(m, k, n, seed=seed)[0])
        graph.replay()
        torch.testing.assert_close(out, run(), rtol=0, atol=0)  # the same launch: the same bits
        torch.testing.assert_close(out.float(), reference_linear(scheme, x.float(), q_w, s_w, None, bias.float()), **BF16)
    assert not torch.equal(out, eager) and counters.abs().sum() == 0
