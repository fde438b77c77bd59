"""The "triton" MoE backend on FP8 experts under TRITON_INTERPRET=1 (fp32, fp16 activations) against
the torch_native FP8 path: block-wise (1 x bk activation groups) and per-channel (per-token
activations) scales, odd token counts, top-k 1 to 3, chunking; a planted scale error fails."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from backplane.contracts.moe import MoeBackendContext

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the CPU run of Triton needs TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)")
pytest.importorskip("triton")

from backplane.plugins.moe_triton.backend import TritonMoeBackend  # noqa: E402
from backplane.plugins.moe_triton.configs import Config  # noqa: E402
from backplane.plugins.moe_triton.gemm import Launch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from fp8_experts import fp8_layer, torch_native  # noqa: E402

# fp32: the two paths see the same FP8 inputs and differ in the order of the fp32 sums; fp16: h and
# the output are rounded to fp16 in both, and h's rounding may move an FP8 value by one step.
TOL = {torch.float32: 1e-4, torch.float16: 1e-2}
HIDDEN, INTER = 64, 48  # multiples of the 16 x 16 blocks, not of the 32-wide tiles (I)
CONFIG = Config(16, Launch(block_n=32, block_k=32), Launch(block_n=32, block_k=32))


def _backend(dtype, max_num_tokens=64):
    ctx = MoeBackendContext(dtype=dtype, device=torch.device("cpu"), max_num_tokens=max_num_tokens, quant="fp8")
    return TritonMoeBackend(ctx, CONFIG)


def _inputs(num_tokens, top_k, num_experts, gen, dtype):
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(dtype)
    weights = torch.softmax(torch.randn(num_tokens, top_k, generator=gen), -1)
    ids = torch.randn(num_tokens, num_experts, generator=gen).topk(top_k, -1).indices.to(torch.int32)
    return x, weights, ids


@pytest.mark.parametrize("fmt", ["block", "channel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("num_tokens", "top_k"), [(1, 1), (17, 3)])
def test_fp8_triton_equals_torch_native(fmt, dtype, num_tokens, top_k):
    gen = torch.Generator().manual_seed(num_tokens + top_k)
    layer = fp8_layer(fmt, 5, HIDDEN, INTER, gen)
    x, weights, ids = _inputs(num_tokens, top_k, 5, gen, dtype)
    out = _backend(dtype).apply(layer, x, weights, ids)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.float(), torch_native(layer, x, weights, ids).float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_chunks_equal_one_pass_and_a_planted_scale_error_fails():
    gen = torch.Generator().manual_seed(7)
    layer = fp8_layer("block", 4, HIDDEN, INTER, gen)
    x, weights, ids = _inputs(11, 2, 4, gen, torch.float32)
    want = torch_native(layer, x, weights, ids)
    torch.testing.assert_close(_backend(torch.float32, max_num_tokens=4).apply(layer, x, weights, ids), want,
                               atol=1e-4, rtol=1e-4)  # three chunks of at most 4 tokens
    layer.w2_weight_scale_inv[ids[0, 0].item(), 2, 1] *= 1.5  # one block of an expert token 0 uses
    got = _backend(torch.float32).apply(layer, x, weights, ids)
    assert not torch.allclose(got, want, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(got, torch_native(layer, x, weights, ids), atol=1e-4, rtol=1e-4)


def test_an_unsupported_quantization_is_one_line():
    ctx = MoeBackendContext(dtype=torch.float32, device=torch.device("cpu"), max_num_tokens=8, quant="int4")
    with pytest.raises(ValueError, match=r"quantization 'int4' is not supported; expected unquantized expert weights "
                                         r"or one of fp8"):
        TritonMoeBackend(ctx)
