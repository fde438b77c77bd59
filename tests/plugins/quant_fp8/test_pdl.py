"""Programmatic dependent launch (`--fp8.pdl`, on by default) on CPU: under Triton's interpreter the
kernels take their PDL order of loads (the first weight tile before x is read, and in the tl.dot
kernel that step taken before the loop) without the wait itself, and must give the same numbers,
bit for bit, as the plain order, for every kernel, split K with an empty slice, ragged K, fused and
separate quantization. The option reaches the kernels; the wait and the launch attribute stay off
where the GPU lacks them (here: no GPU at all)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from backplane.contracts import QuantContext
from backplane.plugins.ops_triton import kernels as ops_kernels
from backplane.plugins.quant_fp8 import cuda
from backplane.plugins.quant_fp8 import kernels as qk
from backplane.plugins.quant_fp8 import quantize as fq
from backplane.plugins.quant_fp8.config import make_config
from backplane.plugins.quant_fp8.options import BUNDLED, Fp8Options, TableSource
from backplane.plugins.quant_fp8.scheme import Fp8Scheme

from test_decode_kernel import activations, channel_weights

N = 80  # five 16-column tiles
CHANNEL_LAUNCHES = {
    "dot": qk.Launch(block_n=32, block_k=32),
    "dot-fused": qk.Launch(block_n=32, block_k=64, fuse_quant=True),
    # K = 288 is 9 steps of 32: split 4 takes 3 steps a slice, so the fourth slice is empty
    "dot-split4-empty-slice": qk.Launch(block_n=16, block_k=32, split_k=4, fuse_quant=True),
    "gemv-prefetch": qk.Launch(block_n=16, block_k=32, split_k=3, num_stages=2, fuse_quant=True, gemv=True),
    "gemv-prefetch-prequantized": qk.Launch(block_n=32, block_k=32, split_k=2, num_stages=3, gemv=True),
    "gemv-no-prefetch": qk.Launch(block_n=32, block_k=32, num_stages=1, fuse_quant=True, gemv=True),
}


def _pair(fn):
    """fn(pdl) run both ways: (plain, PDL order)."""
    return fn(False), fn(True)


@pytest.mark.parametrize("k", [288, 200])  # 200: ragged K (no EVEN_K; the last step masked)
@pytest.mark.parametrize("name,m", [(name, m) for name, launch in sorted(CHANNEL_LAUNCHES.items())
                                    for m in (1, 3, 20) if m <= qk.GEMV_MAX_ROWS or not launch.gemv])
def test_the_pdl_order_gives_the_same_bits_in_every_channel_kernel(name, m, k):
    launch = CHANNEL_LAUNCHES[name]
    q_w, s_w = channel_weights(N, k, seed=k + m)
    x = activations(m, k, seed=m)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(k))
    counters = qk.new_counters(q_w)
    plain, pdl = _pair(lambda pdl: qk.channel_matmul(x, q_w, s_w, bias, launch, counters, pdl=pdl))
    assert torch.equal(plain, pdl), f"{name}: PDL order differs by {(plain - pdl).abs().max():.3g}"
    assert counters.abs().sum() == 0
    # the comparison can fail: the same GEMM without its bias is another result
    assert not torch.equal(pdl, qk.channel_matmul(x, q_w, s_w, None, launch, counters, pdl=True))


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("gemv", [False, True])
@pytest.mark.parametrize("fuse", [False, True])
def test_the_pdl_order_gives_the_same_bits_in_the_block_kernels(fuse, gemv, m, split):
    gen = torch.Generator().manual_seed(m * 7 + split)
    q_w, s_w = fq.quantize_weight_blocks(torch.randn(N, 128, generator=gen) * 0.1, 16, 16)
    x = activations(m, 128, seed=m)
    launch = qk.Launch(block_n=16, block_k=16, split_k=split, num_stages=2, fuse_quant=fuse, gemv=gemv)
    plain, pdl = _pair(lambda pdl: qk.block_matmul(x, q_w, s_w, (16, 16), None, launch, pdl=pdl))
    assert torch.equal(plain, pdl)


def test_no_wait_and_no_launch_attribute_without_a_hopper_gpu():
    assert not qk.pdl_device(torch.device("cpu"))
    assert not ops_kernels.trigger_next(torch.device("cpu"))


@pytest.mark.parametrize("build,capability,want", [("12.8", (9, 0), True), ("12.8", (8, 9), False),
                                                   (None, (9, 4), False)], ids=["hopper", "ada", "rocm-mi300"])
def test_only_an_nvidia_hopper_build_waits_or_triggers(monkeypatch, build, capability, want):
    """A ROCm build of torch reports "cuda" devices of capability 9.x (MI300: 9.4): griddepcontrol is
    NVIDIA's, so neither the wait nor the trigger may be compiled there."""
    from backplane.plugins.attention_triton import configs as attention_configs

    monkeypatch.setattr(torch.version, "cuda", build)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(qk, "INTERPRETED", False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    caches = (qk._pdl_capable, ops_kernels._trigger_capable, attention_configs.trigger_next)
    for cached in caches:
        cached.cache_clear()
    try:
        device = torch.device("cuda", 0)
        assert ops_kernels.trigger_next(device) is want and attention_configs.trigger_next(device) is want
        assert qk.pdl_device(device) is want  # NOTE: the Triton here (3.9) has griddepcontrol and launch_pdl
    finally:
        for cached in caches:
            cached.cache_clear()


def test_the_option_reaches_the_kernels(monkeypatch):
    def config(**options):
        return make_config(QuantContext(None, torch.bfloat16, torch.device("cpu"), options=Fp8Options(**options)))

    assert config().table == BUNDLED and BUNDLED.pdl
    off = config(pdl=False).table
    assert off == TableSource(pdl=False) and off != BUNDLED
    seen = []
    monkeypatch.setattr(cuda, "channel_matmul", lambda *a, **kw: seen.append(("channel", kw["pdl"])))
    monkeypatch.setattr(cuda, "block_matmul", lambda *a, **kw: seen.append(("block", kw["pdl"])))
    monkeypatch.setattr(cuda, "choose", lambda *a, **kw: ("triton", CHANNEL_LAUNCHES["dot"]))
    x, w = torch.zeros(1, 32), torch.zeros(16, 32)
    channel = Fp8Scheme(weights="channel", activations="token")
    block = Fp8Scheme(weights="block", activations="group", block=(16, 16), scale_name="weight_scale_inv")
    for source in (BUNDLED, off):
        cuda.cuda_linear(channel, x, w, torch.ones(16, 1), None, None, None, source)
        cuda.cuda_linear(block, x, w, torch.ones(1, 2), None, None, None, source)
    assert seen == [("channel", True), ("block", True), ("channel", False), ("block", False)]


def test_the_flag_parses_both_ways():
    assert Fp8Options.model_validate({"pdl": "false"}).pdl is False
    assert Fp8Options().pdl is True
    with pytest.raises(ValueError, match="pdl"):
        Fp8Options.model_validate({"pdl": "sometimes"})


def test_a_launch_is_still_frozen_data():
    """pdl is an option of the layer, not a field of a table's launch: tables written before it load."""
    assert "pdl" not in {f.name for f in dataclasses.fields(qk.Launch)}
