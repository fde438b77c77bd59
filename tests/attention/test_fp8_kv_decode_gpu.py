"""The triton decode kernel over an FP8 KV pool on the GPU with the 1-byte launch settings (five
pipeline stages on Hopper) against attention over the dequantized values, in fp32 and through the bf16 pool
of the same values. Run with `pytest -m gpu tests/attention/test_fp8_kv_decode_gpu.py` (bench/run.py
group fp8-kv-attn). The CPU half (the settings table, the interpreted kernel) is in
test_fp8_kv_cache.py.

Tolerance: atol = rtol = 2e-2, bf16 arithmetic against fp32 on the same values (the other GPU
attention tests' figure).
"""

from __future__ import annotations


import pytest
import torch

pytest.importorskip("triton")

from backplane.contracts.memory import dequantize_kv  # noqa: E402
from backplane.plugins.attention_triton import decode_kernels  # noqa: E402
from backplane.plugins.attention_triton.configs import DecodeConfig, decode_config  # noqa: E402

from helpers_gpu import compiled_triton_marks  # noqa: E402
from helpers_kv import shuffled_fp8_pool  # noqa: E402

pytestmark = compiled_triton_marks(decode_kernels._decode_split_kernel, "pytest -m gpu on this file")
BF16 = torch.bfloat16
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # llama-3.1-8b
K_SCALE, V_SCALE = 0.03, 0.02  # values ~ N(0, 1) stay below 448 * scale
TOL = dict(atol=2e-2, rtol=2e-2)


def fp8_pool(seq_lens: list[int], gen: torch.Generator):
    """The shuffled FP8 pool of these shapes and scales on the GPU (tests/helpers_kv.py)."""
    return shuffled_fp8_pool(seq_lens, gen, KV_HEADS, HEAD_DIM, (K_SCALE, V_SCALE), "cuda")


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
    """Plain fp32 attention of one token. q: [H, D]; keys, values: [S, Hkv, D] -> [H, D]."""
    group = q.shape[0] // keys.shape[1]
    k, v = keys.float().repeat_interleave(group, 1), values.float().repeat_interleave(group, 1)
    probs = torch.softmax(torch.einsum("hd,shd->hs", q.float(), k) * scaling, -1)
    return torch.einsum("hs,shd->hd", probs, v)


def test_default_settings_for_fp8_kv_on_hopper_take_five_stages():
    major, _ = torch.cuda.get_device_capability()
    if major < 9:
        pytest.skip("the 1-byte settings differ from bf16's on Hopper and later only")
    assert decode_config(HEAD_DIM, torch.device("cuda"), 1) == DecodeConfig(num_stages=5)
    assert decode_config(HEAD_DIM, torch.device("cuda"), 2) == DecodeConfig()


@pytest.mark.parametrize("config", [None, DecodeConfig(block_n=128)], ids=["default", "block_n-128"])
@pytest.mark.parametrize("splits,counters", [(2, True), (4, False), (16, True)])
def test_fp8_decode_matches_the_dequantized_cache(config, splits, counters):
    """Lengths 1, under, at, over a multiple of 128 and 4099; the in-kernel merge (<= 4 splits with
    counters) and the merge kernel. The same launch over a bf16 pool holding the dequantized values
    agrees too (what the FP8 pool stands in for)."""
    gen = torch.Generator().manual_seed(splits)
    seq_lens = [1, 127, 128, 129, 1000, 4099]
    k_buf, v_buf, req_to_token, rows = fp8_pool(seq_lens, gen)
    bs = len(seq_lens)
    q = torch.randn(bs, HEADS, HEAD_DIM, generator=gen).to(BF16).cuda()
    lens, scaling = torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), HEAD_DIM**-0.5

    def decode(k, v, k_scale, v_scale):
        merge_counters = torch.zeros(bs * KV_HEADS, dtype=torch.int32, device="cuda") if counters else None
        out = decode_kernels.decode_attention(q, k, v, torch.empty_like(q), req_to_token, rows, lens, scaling, splits,
                                              config=config, merge_counters=merge_counters, k_scale=k_scale,
                                              v_scale=v_scale)
        assert merge_counters is None or not merge_counters.any(), "a merge counter was left armed"
        return out

    got = decode(k_buf, v_buf, K_SCALE, V_SCALE)
    k_bf16, v_bf16 = dequantize_kv(k_buf, K_SCALE).to(BF16), dequantize_kv(v_buf, V_SCALE).to(BF16)
    via_bf16 = decode(k_bf16, v_bf16, 1.0, 1.0)
    for b, n in enumerate(seq_lens):
        used = req_to_token[rows[b], :n].long()
        want = attend(q[b], dequantize_kv(k_buf[used], K_SCALE), dequantize_kv(v_buf[used], V_SCALE), scaling)
        torch.testing.assert_close(got[b].float(), want, **TOL, msg=f"request {b} of {n} keys")
        torch.testing.assert_close(got[b].float(), via_bf16[b].float(), **TOL, msg=f"request {b}: fp8 vs bf16 pool")
