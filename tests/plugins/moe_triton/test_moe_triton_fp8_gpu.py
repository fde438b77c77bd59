"""The "triton" MoE backend on FP8 experts compiled on CUDA (FP8 dots need compute capability 8.9):
bf16 activations against the torch_native FP8 path for block-wise (128 x 128, as Qwen3-30B-A3B-FP8)
and per-channel scales, with the default and tuned launch choices; a CUDA-graph replay with new
routing and new inputs equal to eager."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from backplane.contracts.moe import MoeBackendContext

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                       reason="FP8 dots need compute capability 8.9 or newer"),
    pytest.mark.skipif(INTERPRETED, reason="TRITON_INTERPRET=1 is set: the kernels would run interpreted; run "
                                           "the GPU tests in their own process without it"),
]
pytest.importorskip("triton")

from backplane.plugins.moe_triton.backend import TritonMoeBackend  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from fp8_experts import fp8_layer, torch_native  # noqa: E402

E, H, I, TOP_K = 8, 512, 384, 2  # noqa: E741 (I: the intermediate size)
# bf16: h is rounded to bf16 in both paths and an FP8 step of it may differ where the fp32 sums do
TOL = 3e-2


def _backend(max_num_tokens=256):
    ctx = MoeBackendContext(dtype=torch.bfloat16, device=torch.device("cuda"), max_num_tokens=max_num_tokens, quant="fp8")
    return TritonMoeBackend(ctx)


def _inputs(num_tokens, gen):
    x = torch.randn(num_tokens, H, generator=gen).to("cuda", torch.bfloat16)
    weights = torch.softmax(torch.randn(num_tokens, TOP_K, generator=gen), -1).cuda()
    ids = torch.randn(num_tokens, E, generator=gen).topk(TOP_K, -1).indices.to("cuda", torch.int32)
    return x, weights, ids


@pytest.mark.parametrize("fmt", ["block", "channel"])
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 200])
def test_fp8_bf16_equals_torch_native(fmt, num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    layer = fp8_layer(fmt, E, H, I, gen, device="cuda", block=(128, 128))
    x, weights, ids = _inputs(num_tokens, gen)
    out = _backend().apply(layer, x, weights, ids)
    want = torch_native(layer, x, weights, ids)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want.float(), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("fmt", ["block", "channel"])
def test_fp8_graph_replay_with_new_routing_equals_eager(fmt):
    gen = torch.Generator().manual_seed(5)
    layer = fp8_layer(fmt, E, H, I, gen, device="cuda", block=(128, 128))
    backend = _backend()
    x, weights, ids = _inputs(16, gen)
    backend.apply(layer, x, weights, ids)  # warm up: compile the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.apply(layer, x, weights, ids)
    for _ in range(2):
        new_x, new_weights, new_ids = _inputs(16, gen)
        x.copy_(new_x)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, backend.apply(layer, x, weights, ids), atol=0, rtol=0)
        torch.testing.assert_close(out.float(), torch_native(layer, x, weights, ids).float(), atol=TOL, rtol=TOL)
