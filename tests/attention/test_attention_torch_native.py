"""torch_native attention against a per-query, per-head formula written here.

Scenarios run real pools: a first extend, a second extend on top of the cached prefix, then a
decode step; plus custom masks (TARGET_VERIFY), sliding windows, soft-caps, GQA and MHA.
"""

from __future__ import annotations

import pytest
import torch
from helpers_models import BatchBuilder

from backplane.contracts.attention import AttentionLayerInfo
from backplane.attention.torch_native import SPEC, TorchNativeAttnBackend
from backplane.contracts.batch import ForwardMode

HEAD_DIM = 24
LAYER = 1  # not the first layer, so a backend writing layer 0 fails


def reference_attention(q, keys, values, visible, info: AttentionLayerInfo):
    """q: [H, D] of one token; keys, values: [S, Hk, D]; visible: [S] bool -> [H, D]."""
    group = info.num_heads // info.num_kv_heads
    out = torch.empty_like(q)
    for h in range(info.num_heads):
        scores = (keys[:, h // group] @ q[h]) * info.scaling  # [S]
        if info.logit_softcap:
            scores = info.logit_softcap * torch.tanh(scores / info.logit_softcap)
        scores = torch.where(visible, scores, torch.tensor(float("-inf")))
        out[h] = torch.softmax(scores, dim=0) @ values[:, h // group]
    return out


class Scenario:
    """Random K/V history per request, kept here independently of the pools."""

    def __init__(self, info: AttentionLayerInfo, num_requests: int, seed: int):
        self.info = info
        self.gen = torch.Generator().manual_seed(seed)
        self.builder = BatchBuilder(num_layers=2, num_kv_heads=info.num_kv_heads, head_dim=HEAD_DIM,
                                    max_requests=max(num_requests, 1))
        self.reqs = [self.builder.add_request() for _ in range(num_requests)]
        self.keys = [torch.empty(0, info.num_kv_heads, HEAD_DIM) for _ in self.reqs]
        self.values = [torch.empty(0, info.num_kv_heads, HEAD_DIM) for _ in self.reqs]
        self.backend = TorchNativeAttnBackend(None)

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.gen)

    def step(self, new_lens, mode=ForwardMode.EXTEND, masks=None):
        """Run one forward with `new_lens` new tokens per request; return (ours, expected)."""
        n, info = sum(new_lens), self.info
        q = self.randn(n, info.num_heads, HEAD_DIM)
        k, v = self.randn(n, info.num_kv_heads, HEAD_DIM), self.randn(n, info.num_kv_heads, HEAD_DIM)
        extra = {}
        if masks is not None:
            extra["custom_mask"] = torch.cat([m.flatten() for m in masks])
            sizes = torch.tensor([0] + [m.numel() for m in masks])
            extra["mask_indptr"] = torch.cumsum(sizes, 0)
        tokens = [[7] * length for length in new_lens]
        if mode is ForwardMode.DECODE:
            batch = self.builder.decode(self.reqs, [7] * len(self.reqs))
        else:
            batch = self.builder.extend(self.reqs, tokens, mode=mode, **extra)
        self.backend.init_forward_metadata(batch)
        ours = self.backend.forward(q, k, v, info, batch)
        kb, vb = batch.token_to_kv_pool.get_kv_buffer(info.layer_id)
        assert torch.equal(kb[batch.out_cache_loc], k) and torch.equal(vb[batch.out_cache_loc], v)
        return ours, self.expected(q, k, v, new_lens, masks)

    def expected(self, q, k, v, new_lens, masks):
        out, start = torch.empty_like(q), 0
        for r, length in enumerate(new_lens):
            self.keys[r] = torch.cat([self.keys[r], k[start : start + length]])
            self.values[r] = torch.cat([self.values[r], v[start : start + length]])
            seq_len = self.keys[r].shape[0]
            for j in range(length):
                q_pos = seq_len - length + j
                visible = self.visible(q_pos, seq_len, None if masks is None else masks[r][j])
                out[start + j] = reference_attention(q[start + j], self.keys[r], self.values[r], visible, self.info)
            start += length
        return out

    def visible(self, q_pos, seq_len, mask_row):
        window = self.info.sliding_window
        flags = []
        for k_pos in range(seq_len):
            ok = bool(mask_row[k_pos]) if mask_row is not None else k_pos <= q_pos
            flags.append(ok and (window == 0 or k_pos > q_pos - window))
        return torch.tensor(flags)


def make_info(num_heads=6, num_kv_heads=2, window=0, softcap=0.0):
    return AttentionLayerInfo(LAYER, num_heads, num_kv_heads, HEAD_DIM, scaling=0.3,
                              sliding_window=window, logit_softcap=softcap)


CASES = {
    "gqa": make_info(),
    "mha": make_info(num_heads=3, num_kv_heads=3),
    "mqa-window": make_info(num_heads=4, num_kv_heads=1, window=4),
    "softcap": make_info(softcap=2.5),
    "window-softcap": make_info(window=3, softcap=4.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_extend_prefix_then_decode(case):
    scenario = Scenario(CASES[case], num_requests=3, seed=len(case))
    for new_lens, mode in (([5, 1, 13], ForwardMode.EXTEND), ([4, 7, 2], ForwardMode.EXTEND),
                           ([3, 2, 1], ForwardMode.DRAFT_EXTEND), ([1, 1, 1], ForwardMode.DECODE)):
        ours, expected = scenario.step(new_lens, mode)
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5, msg=f"{case} {mode} {new_lens}")


def test_single_request_decode_batch_of_17():
    scenario = Scenario(make_info(), num_requests=17, seed=5)
    scenario.step([(i * 5) % 11 + 1 for i in range(17)])
    ours, expected = scenario.step([1] * 17, ForwardMode.DECODE)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [0, 3])
def test_target_verify_custom_mask(window):
    scenario = Scenario(make_info(window=window), num_requests=2, seed=11)
    scenario.step([6, 9])
    new_lens = [4, 3]
    masks = []
    for r, length in enumerate(new_lens):
        seq_len = scenario.keys[r].shape[0] + length
        mask = torch.rand(length, seq_len, generator=scenario.gen) < 0.5
        mask[torch.arange(length), seq_len - length + torch.arange(length)] = True  # each sees itself
        masks.append(mask)
    ours, expected = scenario.step(new_lens, ForwardMode.TARGET_VERIFY, masks)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


def test_custom_mask_differs_from_causal():
    """The mask really is read: an all-visible mask gives different output than causal attention."""
    causal_run, masked_run = (Scenario(make_info(), num_requests=1, seed=2) for _ in range(2))
    causal_run.step([5])
    masked_run.step([5])  # same seed: both see the same q, k, v
    causal, _ = causal_run.step([3], ForwardMode.EXTEND)
    full_mask = [torch.ones(3, 5 + 3, dtype=torch.bool)]
    masked, expected = masked_run.step([3], ForwardMode.TARGET_VERIFY, full_mask)
    torch.testing.assert_close(masked, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(masked[2], causal[2], rtol=1e-5, atol=1e-5)  # the last query sees all anyway
    assert not torch.allclose(masked[:2], causal[:2], atol=1e-3)


def test_target_verify_without_mask_is_an_error():
    scenario = Scenario(make_info(), num_requests=1, seed=3)
    with pytest.raises(ValueError, match="TARGET_VERIFY needs batch.custom_mask"):
        scenario.step([2], ForwardMode.TARGET_VERIFY)


def test_spec_declares_no_graph_modes_and_lowest_priority():
    assert SPEC.name == "torch_native" and SPEC.graph_modes == () and SPEC.priority == 0
    assert SPEC.platforms == ("cpu", "cuda")
    assert isinstance(SPEC.factory(None), TorchNativeAttnBackend)
