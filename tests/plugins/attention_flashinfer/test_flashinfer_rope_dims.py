"""The flashinfer plugin's rotary op takes FlashInfer's kernel only for the heads it rotates
correctly, and native for the others (head_dim 16 in bf16 went to the kernel and came back with
the second half of every head wrong: the tiny GPU LoRA-over-FP8 test's logits were 0.39 relative
off the exact ones). On CPU with a stand-in `flashinfer` that records its calls; on the GPU
(`gpu`) the real op against native at every head size, kernel or not."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from backplane.ops import native
from backplane.plugins.attention_flashinfer import ops

# (head_dim, rotary_dim, dtype, whether FlashInfer's kernel is taken)
CASES = [
    (16, 16, torch.bfloat16, False),  # one thread a head: its second half rotated with the first's sign
    (16, 16, torch.float16, False),
    (80, 80, torch.bfloat16, False),  # 16-element runs straddle the half at 40
    (96, 64, torch.bfloat16, False),  # partial rotary on the RopeQuantize path
    (32, 32, torch.bfloat16, True),
    (64, 64, torch.bfloat16, True),
    (128, 64, torch.bfloat16, True),
    (128, 128, torch.float16, True),
]


def _inputs(head_dim: int, rotary_dim: int, dtype: torch.dtype, device: str = "cpu"):
    gen = torch.Generator().manual_seed(head_dim + rotary_dim)
    qkv = torch.randn(7, 8 * head_dim, generator=gen).to(dtype)  # q, k and v heads of one projection, as Llama
    q = qkv[:, : 4 * head_dim].view(7, 4, head_dim)
    k = qkv[:, 4 * head_dim : 6 * head_dim].view(7, 2, head_dim)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    freqs = torch.outer(torch.arange(40, dtype=torch.float32), inv_freq)
    cache = torch.cat((freqs.cos(), freqs.sin()), -1)  # [max_pos, rotary_dim]
    positions = torch.tensor([0, 1, 2, 3, 17, 38, 39])
    return [t.to(device) for t in (positions, q, k, cache)]


@pytest.fixture
def recording_flashinfer(monkeypatch):
    """A stand-in flashinfer whose rope records (head_size, dtype) and returns copies of q and k; every
    tensor reads as a CUDA one while the test runs, so the op's own checks let the kernel be called."""
    calls = []

    def apply_rope_with_cos_sin_cache(positions, query, key, head_size, cos_sin_cache, is_neox=True):
        calls.append((head_size, query.dtype))
        return query.clone(), key.clone()

    module = types.ModuleType("flashinfer")
    module.apply_rope_with_cos_sin_cache = apply_rope_with_cos_sin_cache
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    return calls


@pytest.mark.parametrize("head_dim, rotary_dim, dtype, kernel", CASES)
def test_the_kernel_is_taken_only_where_it_rotates_correctly(recording_flashinfer, head_dim, rotary_dim, dtype,
                                                              kernel):
    positions, q, k, cache = _inputs(head_dim, rotary_dim, dtype)
    got = ops.rotary_embedding(positions, q, k, cache, True)
    assert recording_flashinfer == ([(head_dim, dtype)] if kernel else [])
    if not kernel:
        for g, want in zip(got, native.rotary_embedding(positions, q, k, cache, True)):
            torch.testing.assert_close(g, want, atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_dim, rotary_dim, dtype, kernel", CASES)
def test_every_head_size_rotates_as_native_on_cuda(head_dim, rotary_dim, dtype, kernel, is_neox):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("flashinfer")
    positions, q, k, cache = _inputs(head_dim, rotary_dim, dtype, "cuda")
    got = ops.rotary_embedding(positions, q, k, cache, is_neox)
    for g, want in zip(got, native.rotary_embedding(positions, q, k, cache, is_neox)):
        torch.testing.assert_close(g.float(), want.float(), atol=2e-2, rtol=2e-2)
