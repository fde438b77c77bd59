"""FP8 experts in the core: the torch_native path against a per-token loop over hand-dequantized
weights with hand-quantized inputs (block and per-channel scales); FusedMoE creating and loading the
scales (per-channel, per-tensor, block, split over two ranks) and its one-line refusals; online
per-channel quantization; ExpertQuant's own checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backplane.contracts import ExpertQuant
from backplane.layers import FusedMoE, ParallelContext
from backplane.models import ModelContext
from backplane.moe import moe_reference

FP8 = torch.float8_e4m3fn
BLOCK = ExpertQuant("fp8", FP8, scales="block", activations="group", block=(8, 8), scale_name="weight_scale_inv")
CHANNEL = ExpertQuant("fp8", FP8)
E, H, I = 4, 16, 24  # noqa: E741


class OneOfTwoRanks(ParallelContext):
    def all_reduce(self, x):
        return x


def _fake_quant(x: torch.Tensor, group: int) -> torch.Tensor:
    """Per row and run of `group` columns: x / (amax / 448) rounded to e4m3, times the scale."""
    g = x.float().reshape(x.shape[0], -1, group)
    scale = (g.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12)
    return ((g / scale).to(FP8).float() * scale).reshape(x.shape)


def _plain(x, w13, w2, weights, ids, group13, group2):
    """One token and choice at a time over fp32 weights (already dequantized)."""
    out = torch.zeros(x.shape)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up = _fake_quant(x[t:t + 1], group13) @ w13[e].T
            h = F.silu(gate_up[:, :I]) * gate_up[:, I:]
            out[t] += float(weights[t, j]) * (_fake_quant(h, group2) @ w2[e].T)[0]
    return out


def _quantized(quant, gen):
    """FP8 weights and scales of E random experts, and their dequantized fp32 values."""
    w13, w2 = torch.randn(E, 2 * I, H, generator=gen), torch.randn(E, H, I, generator=gen)
    if quant.scales == "channel":
        s13, s2 = w13.abs().amax(-1) / 448, w2.abs().amax(-1) / 448
        q13, q2 = (w13 / s13[..., None]).to(FP8), (w2 / s2[..., None]).to(FP8)
        return (q13, q2, s13, s2), (q13.float() * s13[..., None], q2.float() * s2[..., None])
    s13 = torch.rand(E, 2 * I // 8, H // 8, generator=gen) / 100 + 1e-3
    s2 = torch.rand(E, H // 8, I // 8, generator=gen) / 100 + 1e-3
    q13, q2 = (w13 * 40).clamp(-448, 448).to(FP8), (w2 * 40).clamp(-448, 448).to(FP8)
    full = lambda q, s: q.float() * s.repeat_interleave(8, 1).repeat_interleave(8, 2)  # noqa: E731
    return (q13, q2, s13, s2), (full(q13, s13), full(q2, s2))


@pytest.mark.parametrize("quant", [BLOCK, CHANNEL], ids=["block", "channel"])
def test_torch_native_fp8_equals_a_plain_loop(quant):
    gen = torch.Generator().manual_seed(0)
    (q13, q2, s13, s2), (w13, w2) = _quantized(quant, gen)
    x = torch.randn(9, H, generator=gen)
    weights = torch.softmax(torch.randn(9, 2, generator=gen), -1)
    ids = torch.randn(9, E, generator=gen).topk(2, -1).indices.to(torch.int32)
    got = moe_reference(x, q13, q2, weights, ids, quant, s13, s2)
    groups = (8, 8) if quant.scales == "block" else (H, I)
    want = _plain(x, w13, w2, weights, ids, *groups)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    s2_wrong = s2.clone()
    s2_wrong[int(ids[0, 0])] *= 1.1
    assert not torch.allclose(moe_reference(x, q13, q2, weights, ids, quant, s13, s2_wrong), want, atol=1e-3)


def _layer(quant, parallel=None) -> FusedMoE:
    layer = FusedMoE(E, 2, H, I, ModelContext(parallel=parallel), layer_id=0, renormalize=True)
    layer.set_expert_quant(quant)
    return layer


def test_block_scales_load_into_each_experts_rows_and_split_over_ranks():
    gen = torch.Generator().manual_seed(1)
    gate, up, down = (torch.rand(I // 8, H // 8, generator=gen), torch.rand(I // 8, H // 8, generator=gen),
                      torch.rand(H // 8, I // 8, generator=gen))
    whole = _layer(BLOCK)
    assert whole.w13_weight.dtype == FP8 and whole.w13_weight_scale_inv.shape == (E, 2 * I // 8, H // 8)
    for shard, scale in (("w1", gate), ("w3", up)):
        whole.weight_loader(whole.w13_weight_scale_inv, scale, (2, shard))
    whole.weight_loader(whole.w2_weight_scale_inv, down, (2, "w2"))
    assert torch.equal(whole.w13_weight_scale_inv[2], torch.cat([gate, up]))
    assert torch.equal(whole.w2_weight_scale_inv[2], down)
    small = ExpertQuant("fp8", FP8, scales="block", activations="group", block=(4, 4), scale_name="weight_scale_inv")
    rank = _layer(small, OneOfTwoRanks(tp_rank=1, tp_size=2))  # intermediate rows 12..23: blocks 3..5
    gate4, down4 = torch.rand(I // 4, H // 4, generator=gen), torch.rand(H // 4, I // 4, generator=gen)
    rank.weight_loader(rank.w13_weight_scale_inv, gate4, (1, "w1"))
    rank.weight_loader(rank.w2_weight_scale_inv, down4, (1, "w2"))
    assert torch.equal(rank.w13_weight_scale_inv[1, :3], gate4[3:]) and torch.equal(rank.w2_weight_scale_inv[1], down4[:, 3:])
    with pytest.raises(ValueError, match=r"expert weight blocks \[8, 8\] do not divide the intermediate size per rank 12"):
        _layer(BLOCK, OneOfTwoRanks(tp_rank=1, tp_size=2))  # 12 rows per rank: not a multiple of 8


def test_channel_scales_load_per_row_or_from_one_per_tensor_value():
    layer = _layer(CHANNEL, OneOfTwoRanks(tp_rank=1, tp_size=2))  # this rank: intermediate rows 12..23
    assert layer.w13_weight_scale.shape == (E, I) and layer.w2_weight_scale.shape == (E, H)
    gate = torch.arange(I, dtype=torch.float32)[:, None]  # [I, 1] as compressed-tensors stores it
    layer.weight_loader(layer.w13_weight_scale, gate, (0, "w1"))
    layer.weight_loader(layer.w13_weight_scale, torch.tensor([0.5]), (0, "w3"))  # per tensor
    assert torch.equal(layer.w13_weight_scale[0], torch.cat([gate[12:, 0], torch.full((12,), 0.5)]))
    with pytest.raises(ValueError, match=r"MoE layer 0 expert 1 w2 scale: expected the full checkpoint tensor of shape "
                                         r"\(16,\), got \(24,\)"):
        layer.weight_loader(layer.w2_weight_scale, torch.ones(I, 1), (1, "w2"))


def test_fp8_weights_into_unquantized_experts_are_refused():
    layer = FusedMoE(E, 2, H, I, ModelContext(), layer_id=3, renormalize=True)
    with pytest.raises(ValueError, match=r"MoE layer 3 expert 0 w1: the checkpoint holds torch.float8_e4m3fn expert "
                                         r"weights but this run keeps the experts in torch.float32"):
        layer.weight_loader(layer.w13_weight, torch.zeros(I, H, dtype=FP8), (0, "w1"))


def test_online_quantization_per_channel_after_loading():
    layer = _layer(ExpertQuant("fp8", FP8, online=True))
    assert layer.w13_weight.dtype == torch.float32  # the checkpoint's dtype until processed
    gen = torch.Generator().manual_seed(2)
    w13, w2 = torch.randn(E, 2 * I, H, generator=gen), torch.randn(E, H, I, generator=gen)
    layer.w13_weight.data.copy_(w13)
    layer.w2_weight.data.copy_(w2)
    layer.process_weights_after_loading()
    assert layer.w13_weight.dtype == FP8 and layer.w13_weight_scale.shape == (E, 2 * I)
    back = layer.w2_weight.float() * layer.w2_weight_scale[..., None]
    assert torch.all((back - w2).abs() <= w2.abs().amax(-1, keepdim=True) / 16)


def test_expert_quant_refuses_inconsistent_fields():
    with pytest.raises(ValueError, match=r"expected block \(bn, bk\) exactly with scales 'block' and activations 'group'"):
        ExpertQuant("fp8", FP8, scales="block", activations="group")
    with pytest.raises(ValueError, match=r"expected scales one of channel, block"):
        ExpertQuant("fp8", FP8, scales="tensor")


def test_online_quantization_per_block_after_loading():
    """Online block scales: one per 8 x 8 tile of each expert (gate tiles, then up tiles), each tile
    within half an e4m3 step of its own largest weight; a stale per-channel layout would not fit."""
    layer = _layer(ExpertQuant("fp8", FP8, scales="block", activations="group", block=(8, 8), online=True))
    gen = torch.Generator().manual_seed(3)
    w13 = torch.randn(E, 2 * I, H, generator=gen) * torch.logspace(-2, 1, H)  # columns of very different sizes
    layer.w13_weight.data.copy_(w13)
    layer.w2_weight.data.copy_(torch.randn(E, H, I, generator=gen))
    layer.process_weights_after_loading()
    assert layer.w13_weight.dtype == FP8 and layer.w13_weight_scale.shape == (E, 2 * I // 8, H // 8)
    full = layer.w13_weight_scale.repeat_interleave(8, 1).repeat_interleave(8, 2)
    back = layer.w13_weight.float() * full
    tile_max = w13.abs().reshape(E, 2 * I // 8, 8, H // 8, 8).amax(dim=(2, 4))
    assert torch.all((back - w13).abs() <= tile_max.repeat_interleave(8, 1).repeat_interleave(8, 2) / 16)
    assert torch.equal(layer.w13_weight_scale, tile_max / torch.finfo(FP8).max)


def test_online_blocks_must_divide_the_expert_sizes():
    with pytest.raises(ValueError, match=r"MoE layer 0: expert weight blocks \[16, 16\] do not divide the intermediate "
                                         r"size per rank 24"):
        _layer(ExpertQuant("fp8", FP8, scales="block", activations="group", block=(16, 16), online=True))
