"""Programmatic dependent launch on the GPU: inside a CUDA graph, the FP8 GEMMs launched with PDL
start while the kernel before them runs (ops_triton's norm, which lets them launch at its start, or
another FP8 GEMM) and must still read that kernel's output, never the previous replay's: every replay
gets new inputs and must equal the plain launches run eagerly. Two GEMMs of one layer back to back
share their split-K counters, which the second may touch only after the first is done."""

from __future__ import annotations

import pytest
import torch

from backplane.plugins.ops_triton import kernels as ops_kernels
from backplane.plugins.quant_fp8 import kernels as qk
from backplane.plugins.quant_fp8 import quantize as fq

pytestmark = pytest.mark.gpu

N, K = 6144, 4096  # Llama-3.1-8B's qkv: N >= K, so a GEMM's output can feed the same weight again
LAUNCHES = {
    "dot-split3-fused": (qk.Launch(64, 256, split_k=3, num_stages=4, fuse_quant=True), "channel"),
    "dot-split4": (qk.Launch(64, 128, split_k=4, num_stages=4), "channel"),
    "dot": (qk.Launch(128, 128, num_warps=8), "channel"),
    "gemv-split8": (qk.Launch(32, 256, split_k=8, num_stages=2, fuse_quant=True, gemv=True), "channel"),
    "block-gemv": (qk.Launch(32, 128, split_k=4, num_stages=2, fuse_quant=True, gemv=True), "block"),
    "block-dot": (qk.Launch(64, 128, split_k=4, num_stages=3, fuse_quant=True), "block"),
}


def test_the_gpu_takes_the_wait_and_the_launch_attribute():
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    assert qk.pdl_device(torch.device("cuda")) and ops_kernels.trigger_next(torch.device("cuda"))


@pytest.mark.parametrize("m", [1, 8, 32])
@pytest.mark.parametrize("name", sorted(LAUNCHES))
def test_pdl_gemms_in_a_graph_read_what_the_kernel_before_wrote(name, m):
    launch, kind = LAUNCHES[name]
    if launch.gemv and m > qk.GEMV_MAX_ROWS:
        pytest.skip("a GEMV launch serves M up to GEMV_MAX_ROWS")
    gen = torch.Generator(device="cuda").manual_seed(m)
    w = torch.randn(N, K, device="cuda", generator=gen) * 0.05
    q_w, s_w = fq.quantize_weight_blocks(w, 128, 128) if kind == "block" else fq.quantize_weight_per_channel(w)
    norm_w = torch.rand(K, device="cuda", generator=gen).to(torch.bfloat16) + 0.5
    counters = qk.new_counters(q_w)

    def gemm(x, pdl):
        if kind == "block":
            return qk.block_matmul(x, q_w, s_w, (128, 128), None, launch, counters, pdl=pdl)
        return qk.channel_matmul(x, q_w, s_w, None, launch, counters, pdl=pdl)

    def layer(src, pdl):
        h = ops_kernels.rms_norm(src, norm_w, 1e-5)  # lets the GEMM launch at its start
        y = gemm(h, pdl)
        return y, gemm(y[:, :K], pdl)  # the same weight and counters again, right after

    src = torch.zeros(m, K, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(src, True)  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(src, True)
    for replay in range(4):
        src.copy_(torch.randn(m, K, device="cuda", generator=gen).to(torch.bfloat16) * (replay + 1))
        graph.replay()
        want = layer(src.clone(), False)
        torch.cuda.synchronize()
        for got, expected in zip(out, want):
            torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)
        assert counters.abs().sum() == 0
