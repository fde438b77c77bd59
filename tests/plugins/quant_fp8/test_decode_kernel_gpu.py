"""quant_fp8's Triton kernels on the GPU, bf16: quantize_rows equals quantize.py bit for bit; the
hardware's e4m3 cast equals torch's; cuda_linear's decode path (channel_matmul, block_matmul) against
the reference and against torch._scaled_mm row-wise at M 1 to 64; every kind of launch (split K,
x quantized inside the GEMM or before it); fp16 models; the dispatch threshold; CUDA graphs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton

from backplane.plugins.quant_fp8 import cuda
from backplane.plugins.quant_fp8 import kernels as qk
from backplane.plugins.quant_fp8 import quantize as fq
from backplane.plugins.quant_fp8.reference import reference_linear
from backplane.plugins.quant_fp8.scheme import Fp8Scheme
from test_decode_kernel import _cast_kernel

pytestmark = pytest.mark.gpu

CHANNEL = Fp8Scheme(weights="channel", activations="token")
ONLINE = Fp8Scheme(weights="channel", activations="token", online=True)
BLOCKWISE = Fp8Scheme(weights="block", activations="group", block=(128, 128), scale_name="weight_scale_inv")
BF16 = dict(rtol=1.6e-2, atol=1e-2)  # bf16 output against the fp32 reference
LAUNCHES = [qk.Launch(64, 256, split_k=3, num_stages=4, fuse_quant=True), qk.Launch(64, 128, split_k=4, num_stages=4),
            qk.Launch(128, 128, num_warps=8), qk.Launch(32, 256, split_k=2, num_warps=8, num_stages=2, fuse_quant=True)]


def weights(scheme: Fp8Scheme, n: int, k: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.05
    if scheme.weights == "block":
        return fq.quantize_weight_blocks(w, *scheme.block)
    return fq.quantize_weight_per_channel(w)


def inputs(m: int, k: int, n: int, seed: int, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=gen) * torch.rand(m, 1, device="cuda", generator=gen) * 4
    return x.to(dtype), torch.randn(n, device="cuda", generator=gen).to(dtype)


def test_the_hardware_cast_is_torchs_at_every_midpoint():
    values = torch.arange(256, dtype=torch.uint8).view(fq.FP8).float()
    values = values[values.isfinite()].unique()
    mids = (values[1:] + values[:-1]) / 2
    x = torch.cat([values, mids, mids * (1 + 2**-22), mids * (1 - 2**-22), torch.tensor([500.0, -1e4, -0.0])]).cuda()
    n = triton.next_power_of_2(x.numel())
    x = torch.cat([x, torch.zeros(n - x.numel(), device="cuda")])
    q = torch.empty(n, dtype=fq.FP8, device="cuda")
    _cast_kernel[(1,)](x, q, N=n)
    assert torch.equal(q.view(torch.uint8), x.clamp(-fq.FP8_MAX, fq.FP8_MAX).to(fq.FP8).view(torch.uint8))


@pytest.mark.parametrize("m, k, group", [(1, 4096, None), (37, 14336, None), (64, 4096, 128), (3, 7168, 128)])
def test_quantize_rows_is_quantize_py_bit_for_bit(m, k, group):
    x, _ = inputs(m, k, 1, seed=k)
    q, scale = qk.quantize_rows(x, group)
    want_q, want_scale = fq.quantize_per_token(x) if group is None else fq.quantize_per_group(x, group)
    assert torch.equal(scale, want_scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("m", [1, 3, 16, 33, 64])
@pytest.mark.parametrize("n, k", [(6144, 4096), (1008, 1040)])  # a Llama-8B shape; tails (_scaled_mm needs 16 | N, K)
def test_channel_path_matches_the_reference_and_scaled_mm(m, n, k):
    q_w, s_w = weights(CHANNEL, n, k, seed=m)
    x, bias = inputs(m, k, n, seed=m + 1)
    counters = qk.new_counters(q_w)
    got = cuda.cuda_linear(CHANNEL, x, q_w, s_w, None, bias, counters)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n) and counters.abs().sum() == 0
    ref = reference_linear(CHANNEL, x.float(), q_w, s_w, None, bias.float())
    torch.testing.assert_close(got.float(), ref, **BF16)
    scaled_mm = cuda._rowwise(CHANNEL, x, q_w, s_w, None, bias)
    torch.testing.assert_close(got, scaled_mm, **BF16)
    planted = reference_linear(CHANNEL, x.float(), q_w, s_w * 1.01, None, bias.float())
    assert not torch.allclose(got.float(), planted, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("launch", LAUNCHES, ids=str)
@pytest.mark.parametrize("m", [1, 16, 64])
def test_every_kind_of_launch(launch, m):
    n, k = 4096, 4096
    q_w, s_w = weights(CHANNEL, n, k, seed=3)
    x, bias = inputs(m, k, n, seed=m)
    got = qk.channel_matmul(x, q_w, s_w, bias, launch, qk.new_counters(q_w))
    torch.testing.assert_close(got.float(), reference_linear(CHANNEL, x.float(), q_w, s_w, None, bias.float()), **BF16)
    q_b, s_b = weights(BLOCKWISE, n, k, seed=4)
    got = qk.block_matmul(x, q_b, s_b, BLOCKWISE.block, bias, launch)
    ref = reference_linear(BLOCKWISE, x.float(), q_b, s_b, None, bias.float())
    torch.testing.assert_close(got.float(), ref, **BF16)


@pytest.mark.parametrize("m", [1, 3, 16, 33, 64, 300])
def test_block_path_matches_the_reference(m):
    n, k = 1000, 2048
    q_w, s_w = weights(BLOCKWISE, n, k, seed=m)
    x, bias = inputs(m, k, n, seed=m + 1)
    got = cuda.cuda_linear(BLOCKWISE, x, q_w, s_w, None, bias)
    ref = reference_linear(BLOCKWISE, x.float(), q_w, s_w, None, bias.float())
    torch.testing.assert_close(got.float(), ref, **BF16)
    planted = s_w.clone()
    planted[2] *= 1.05
    assert not torch.allclose(got.float(), reference_linear(BLOCKWISE, x.float(), q_w, planted, None, bias.float()),
                              rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("m", [1, 128])
def test_fp16_models_take_the_triton_kernel_at_every_size(m):
    n, k = 512, 1024
    q_w, s_w = weights(CHANNEL, n, k, seed=m)
    x, _ = inputs(m, k, n, seed=m, dtype=torch.float16)
    assert cuda.choose(("channel", n, k, None), m, torch.float16, x.device)[0] == "triton"
    got = cuda.cuda_linear(ONLINE, x, q_w, s_w, None, None)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), reference_linear(ONLINE, x.float(), q_w, s_w, None, None), **BF16)


def test_bf16_above_the_threshold_takes_scaled_mm():
    key = ("channel", 7168, 3072, None)  # a shape no bundled table has
    assert cuda.choose(key, cuda.DECODE_MAX_TOKENS, torch.bfloat16, torch.device("cuda"))[0] == "triton"
    assert cuda.choose(key, cuda.DECODE_MAX_TOKENS + 1, torch.bfloat16, torch.device("cuda"))[0] == "scaled_mm"


SPLIT = qk.Launch(64, 128, split_k=4, num_stages=4)


def capture(run):
    """(run's eager result, a CUDA graph of run, the graph's output): warmed up on a side stream, as
    torch's graph capture wants, then captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        eager = run().clone()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    return eager, graph, out


@pytest.mark.parametrize("path", ["channel", "block", "channel-split", "block-split"])
@pytest.mark.parametrize("with_counters", [True, False])
@pytest.mark.parametrize("m", [1, 8, 64])
def test_the_decode_path_replays_in_a_graph(path, with_counters, m):
    """cuda_linear as dispatched (the card's table or the defaults), and explicit split-K launches
    (x quantized inside the GEMM and before it), captured and replayed with new inputs."""
    n, k = 6144, 4096
    scheme = BLOCKWISE if path.startswith("block") else CHANNEL
    q_w, s_w = weights(scheme, n, k, seed=m)
    x, bias = inputs(m, k, n, seed=m)
    counters = qk.new_counters(q_w) if with_counters else None
    split = dataclasses.replace(SPLIT, fuse_quant=m == 1)

    def run():
        if path == "channel-split":
            return qk.channel_matmul(x, q_w, s_w, bias, split, counters)
        if path == "block-split":
            return qk.block_matmul(x, q_w, s_w, scheme.block, bias, split, counters)
        return cuda.cuda_linear(scheme, x, q_w, s_w, None, bias, counters)

    eager, graph, out = capture(run)
    for seed in (11, 12):
        x.copy_(inputs(m, k, n, seed=seed)[0])
        graph.replay()
        torch.testing.assert_close(out, run(), rtol=0, atol=0)  # the same launches: the same bits
        ref = reference_linear(scheme, x.float(), q_w, s_w, None, bias.float())
        torch.testing.assert_close(out.float(), ref, **BF16)
    assert not torch.equal(out, eager)
    if counters is not None:
        assert counters.abs().sum() == 0
