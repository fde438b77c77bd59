"""quant_fp8's Triton kernels on CPU (Triton's interpreter, fp32 and fp16 activations; the FP8 dots
run there too): the e4m3 rounding, quantize_rows, channel_matmul and block_matmul at decode sizes
(M 1 to 64, odd N and K, bias, split K, x quantized inside the GEMM or before it) against
reference.py within FP8 rounding bounds and against the same arithmetic in torch within fp32
rounding; planted scale errors fail. And cuda.py's launch choice: defaults, the table, its errors."""

from __future__ import annotations

import json

import pytest
import torch
import triton
import triton.language as tl

from backplane.plugins.quant_fp8 import cuda
from backplane.plugins.quant_fp8 import kernels as qk
from backplane.plugins.quant_fp8 import quantize as fq
from backplane.plugins.quant_fp8.reference import reference_linear
from backplane.plugins.quant_fp8.scheme import Fp8Scheme

CHANNEL = Fp8Scheme(weights="channel", activations="token")
BLOCK = (16, 16)
BLOCKWISE = Fp8Scheme(weights="block", activations="group", block=BLOCK, scale_name="weight_scale_inv")
RECIPROCAL = torch.tensor(1 / fq.FP8_MAX, dtype=torch.float32)  # what torch multiplies by on CUDA for `/ 448`
LAUNCHES = {"plain": qk.Launch(block_n=32, block_k=32), "split3": qk.Launch(block_n=16, block_k=32, split_k=3),
            "fused": qk.Launch(block_n=32, block_k=64, fuse_quant=True),
            "fused-split2": qk.Launch(block_n=16, block_k=32, split_k=2, fuse_quant=True)}


# -- helpers: the arithmetic in torch --------------------------------------------------------------

def quantize_like_cuda(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize.py's per-token / per-group quantization as torch computes it on CUDA: amax times the
    fp32 reciprocal of 448 (on CPU, torch divides; the two can differ in the scale's last bit)."""
    m, k = x.shape
    g = x.float().reshape(m, -1, group or k)
    scale = (g.abs().amax(-1, keepdim=True) * RECIPROCAL).clamp(min=fq.MIN_SCALE)
    q = (g / scale).clamp(-fq.FP8_MAX, fq.FP8_MAX).to(fq.FP8)
    return q.reshape(m, k), scale.reshape(m, -1)


def same_arithmetic(x, q_w, s_w, bias=None, group=None, block=None):
    """The product of the dequantized operands in fp32, x quantized as the kernels quantize it."""
    q, s = quantize_like_cuda(x, group)
    xd = fq.dequantize_groups(q, s) if group else q.float() * s
    y = xd @ fq.dequantize_weight(q_w, s_w, block).t()
    return y if bias is None else y + bias.float()


def fp8_bound(x, q_w, s_w, scheme: Fp8Scheme) -> torch.Tensor:
    """Per output: one e4m3 step (2^-3 relative) of the largest product x_k w_k, plus fp32 sums: how
    far apart two quantizations of x that differ in one element's rounding can be."""
    from backplane.plugins.quant_fp8.reference import dequantized_input

    xd = dequantized_input(scheme, x.float(), None).abs()
    wd = fq.dequantize_weight(q_w, s_w, scheme.block if scheme.weights == "block" else None).abs()
    largest = (xd[:, None, :] * wd[None, :, :]).amax(-1)
    return 2**-3 * largest + 1e-5 * (xd @ wd.t())


def assert_within(got, want, bound):
    excess = (got.float() - want.float()).abs() - bound
    assert excess.max() <= 0, f"{int((excess > 0).sum())} outputs beyond the bound, worst by {excess.max():.3g}"


def channel_weights(n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    w[n // 2] *= 20  # channels of very different ranges: per-channel scales matter
    return fq.quantize_weight_per_channel(w)


def activations(m, k, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4  # rows of different ranges
    return x.to(dtype)


# -- the e4m3 rounding and quantize_rows -----------------------------------------------------------

@triton.jit
def _cast_kernel(x_ptr, q_ptr, N: tl.constexpr):
    r = tl.arange(0, N)
    tl.store(q_ptr + r, qk._to_fp8(tl.load(x_ptr + r), tl.full((N,), 1.0, tl.float32)))


def test_fp8_rounding_matches_torchs_cast_at_every_midpoint():
    values = torch.arange(256, dtype=torch.uint8).view(fq.FP8).float()
    values = values[values.isfinite()].unique()
    mids = (values[1:] + values[:-1]) / 2  # ties: to the even mantissa
    ulp = mids.abs() * 2**-22 + 1e-30
    x = torch.cat([values, mids, mids + ulp, mids - ulp, torch.tensor([500.0, -1e4, 449.0, 1e-9, -0.0])])
    n = triton.next_power_of_2(x.numel())
    x = torch.cat([x, torch.zeros(n - x.numel())])
    q = torch.empty(n, dtype=fq.FP8)
    _cast_kernel[(1,)](x, q, N=n)
    want = x.clamp(-fq.FP8_MAX, fq.FP8_MAX).to(fq.FP8)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("m, k, group, dtype", [(1, 300, None, torch.float32), (3, 4100, None, torch.float16),
                                                 (33, 96, 16, torch.float32), (5, 256, 128, torch.float16)])
def test_quantize_rows_is_quantize_py_on_cuda(m, k, group, dtype):
    x = activations(m, k, seed=k, dtype=dtype)
    x[0, 7] = 0.0
    q, scale = qk.quantize_rows(x, group)
    want_q, want_scale = quantize_like_cuda(x, group)
    assert torch.equal(scale, want_scale) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    # quantize.py on this CPU divides instead: the same scales up to their last bit
    ref_q, ref_scale = fq.quantize_per_token(x) if group is None else fq.quantize_per_group(x, group)
    torch.testing.assert_close(scale, ref_scale, rtol=2**-23, atol=0)


# -- channel_matmul -----------------------------------------------------------------------------------

@pytest.mark.parametrize("launch", list(LAUNCHES))
@pytest.mark.parametrize("m", [1, 3, 16, 33, 64])
def test_channel_matmul_matches_the_reference(m, launch):
    n, k = 72, 200  # N and K not multiples of the tiles
    q_w, s_w = channel_weights(n, k, seed=m)
    x = activations(m, k, seed=m + 1)
    bias = torch.randn(n) if m % 2 else None
    got = qk.channel_matmul(x, q_w, s_w, bias, LAUNCHES[launch])
    assert got.shape == (m, n) and got.dtype == x.dtype
    torch.testing.assert_close(got, same_arithmetic(x, q_w, s_w, bias), rtol=1e-5, atol=1e-5)
    ref = reference_linear(CHANNEL, x, q_w, s_w, None, bias)
    assert_within(got, ref, fp8_bound(x, q_w, s_w, CHANNEL))
    planted = s_w.clone()
    planted[n // 3] *= 1.05  # one channel's scale 5% off
    with pytest.raises(AssertionError):
        assert_within(got, reference_linear(CHANNEL, x, q_w, planted, None, bias), fp8_bound(x, q_w, s_w, CHANNEL))


def test_channel_matmul_fp16_activations_and_output():
    n, k = 40, 128
    q_w, s_w = channel_weights(n, k, seed=5)
    x = activations(8, k, seed=6, dtype=torch.float16)
    for launch in (LAUNCHES["fused"], LAUNCHES["split3"]):
        got = qk.channel_matmul(x, q_w, s_w, None, launch)
        assert got.dtype == torch.float16
        torch.testing.assert_close(got.float(), same_arithmetic(x, q_w, s_w), rtol=1e-3, atol=1e-3)


def test_per_tensor_scales_broadcast():
    """An fp8 x with one static scale, a per-tensor weight scale: both broadcast (stride 0)."""
    n, k = 48, 96
    w = torch.randn(n, k) * 0.05
    q_w, s_w = fq.quantize_per_tensor(w)
    x = activations(5, k, seed=8)
    q_x, s_x = fq.quantize_per_tensor(x, torch.tensor(0.02))
    got = qk.channel_matmul(q_x, q_w, s_w, None, LAUNCHES["split3"], x_scale=s_x, out_dtype=torch.float32)
    want = (q_x.float() * s_x) @ (q_w.float() * s_w).t()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_split_k_leaves_its_counters_at_zero_for_the_next_call():
    n, k = 72, 200
    q_w, s_w = channel_weights(n, k, seed=9)
    counters = qk.new_counters(q_w)
    x = activations(3, k, seed=10)
    first = qk.channel_matmul(x, q_w, s_w, None, LAUNCHES["split3"], counters)
    assert counters.abs().sum() == 0
    x2 = activations(3, k, seed=11)
    second = qk.channel_matmul(x2, q_w, s_w, None, LAUNCHES["split3"], counters)
    torch.testing.assert_close(second, same_arithmetic(x2, q_w, s_w), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(first, second)


def test_bad_scales_and_counters_are_one_line_errors():
    q_w, s_w = channel_weights(40, 64, seed=1)
    x = activations(2, 64, seed=2)
    with pytest.raises(ValueError, match=r"^channel_matmul: weight_scale \(39, 1\), x_scale None: expected one scale"):
        qk.channel_matmul(x, q_w, s_w[:39], None, LAUNCHES["plain"])
    with pytest.raises(ValueError, match=r"^split-K counters: int32 \[1\] on cpu: expected int32 with at least 3 "):
        qk.channel_matmul(x, q_w, s_w, None, LAUNCHES["split3"], torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^block_matmul: weight block \(16, 24\) over K = 64: expected"):
        qk.block_matmul(x, q_w, s_w, (16, 24), None, LAUNCHES["plain"])
    with pytest.raises(ValueError, match=r"^Launch\(block_n=24, .*expected block_n >= 16 and block_k >= 16 powers of two"):
        qk.Launch(block_n=24, block_k=32)


# -- block_matmul -------------------------------------------------------------------------------------

@pytest.mark.parametrize("fuse, split", [(False, 1), (True, 1), (True, 3), (False, 2)])
@pytest.mark.parametrize("m", [1, 3, 16, 33, 64])
def test_block_matmul_matches_the_reference(m, fuse, split):
    n, k = 50, 96  # N ends inside a weight block
    gen = torch.Generator().manual_seed(m)
    q_w, s_w = fq.quantize_weight_blocks(torch.randn(n, k, generator=gen) * 0.05, *BLOCK)
    x = activations(m, k, seed=m + 2)
    bias = torch.randn(n, generator=gen) if split > 1 else None
    launch = qk.Launch(block_n=32 if m < 16 else 16, block_k=16, split_k=split, fuse_quant=fuse)
    got = qk.block_matmul(x, q_w, s_w, BLOCK, bias, launch)
    torch.testing.assert_close(got, same_arithmetic(x, q_w, s_w, bias, BLOCK[1], BLOCK), rtol=1e-5, atol=1e-5)
    ref = reference_linear(BLOCKWISE, x, q_w, s_w, None, bias)
    assert_within(got, ref, fp8_bound(x, q_w, s_w, BLOCKWISE))
    planted = s_w.clone()
    planted[1, 2] *= 1.25  # one weight block's scale off
    with pytest.raises(AssertionError):
        assert_within(got, reference_linear(BLOCKWISE, x, q_w, planted, None, bias), fp8_bound(x, q_w, s_w, BLOCKWISE))


# -- cuda.py's launch choice --------------------------------------------------------------------------

LLAMA_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


@pytest.mark.parametrize("name", list(LLAMA_8B))
@pytest.mark.parametrize("m", [1, 8, 32, 64])
def test_default_launch_fills_the_card_at_decode_sizes(name, m):
    n, k = LLAMA_8B[name]
    launch = cuda.default_launch(("channel", n, k, None), m, 2, num_sms=132)
    programs = triton.cdiv(n, launch.block_n) * launch.split_k
    assert programs >= 132 and (launch.split_k == 1 or programs <= 4 * 132)
    assert triton.cdiv(k, launch.block_k) // launch.split_k >= cuda.MIN_STEPS_PER_SPLIT
    assert launch.fuse_quant == (m * k * 2 <= cuda.FUSE_QUANT_MAX_BYTES)
    block = cuda.default_launch(("block", n, k, (128, 128)), m, 2, num_sms=132)
    assert block.fuse_quant == launch.fuse_quant and block.block_k == 128  # x quantized first past 32 KB
    assert cuda.default_launch(("channel", n, k, None), 512, 2, num_sms=132).split_k == 1


def _table(tmp_path, entries):
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"device": "test", "tuned": True, "entries": entries}))
    return cuda.load_table(path)


def test_the_table_serves_each_token_bucket_its_nearest_entry(tmp_path):
    key = ("channel", 6144, 4096, None)
    fast, wide = qk.Launch(64, 256, split_k=3, fuse_quant=True), qk.Launch(128, 128, num_warps=8)
    table = _table(tmp_path, [cuda.entry(key, 1, "triton", fast, us=9.0), cuda.entry(key, 8, "triton", wide),
                              cuda.entry(key, 128, "scaled_mm", wide),
                              cuda.entry(("block", 6144, 4096, (128, 128)), 1, "triton", wide)])
    assert len(table) == 4 and table.tuned
    assert table.lookup(key, 1) == ("triton", fast) and table.lookup(key, 2) == ("triton", fast)
    assert table.lookup(key, 3) == ("triton", wide) and table.lookup(key, 16) == ("triton", wide)
    assert table.lookup(key, 17) is None and table.lookup(key, 100) == ("scaled_mm", wide)
    assert table.lookup(key, 512) is None and table.lookup(("channel", 4096, 4096, None), 1) is None
    assert table.lookup(("block", 6144, 4096, (128, 128)), 4) == ("triton", wide)


@pytest.mark.parametrize("change, message", [
    ({"use": "cublas"}, r"entry 0: kernel 'channel', use 'cublas', tokens 1: expected kernel one of channel, block"),
    ({"block_n": 48}, r"entry 0: Launch\(block_n=48, .*expected block_n >= 16"),
    ({"block": [128, 128]}, r"entry 0: block \[128, 128\]: expected \[rows, columns\] for kernel 'block'"),
])
def test_a_bad_table_entry_is_one_line(tmp_path, change, message):
    good = cuda.entry(("channel", 64, 64, None), 1, "triton", qk.Launch(64, 64))
    with pytest.raises(ValueError, match=message) as err:
        _table(tmp_path, [{**good, **change}])
    assert "\n" not in str(err.value)
    missing = {k: v for k, v in good.items() if k != "split_k"}
    with pytest.raises(ValueError, match=r"entry 0 lacks split_k; expected the fields kernel, N, K, tokens, use"):
        _table(tmp_path, [missing])


def test_every_bundled_table_parses():
    paths = sorted(cuda.CONFIG_DIR.glob("*.json"))
    if not paths:
        pytest.skip("no bundled launch table yet (plugins/quant_fp8/configs/README.md)")
    for path in paths:
        assert len(cuda.load_table(path)) > 0, path


def test_the_tuners_untuned_table_is_what_cuda_py_chooses(tmp_path):
    from backplane.plugins.quant_fp8 import tune

    out = tmp_path / "defaults.json"
    tune.main(["--defaults", "--device-name", "NVIDIA H100 80GB HBM3", "--out", str(out), "--tokens", "1", "128"])
    table = cuda.load_table(out)
    assert len(table) == 2 * 2 * 4 and not table.tuned  # 2 token counts x 2 kernels x 4 llama-3.1-8b shapes
    key = ("channel", 4096, 14336, None)
    assert table.lookup(key, 1) == ("triton", cuda.default_launch(key, 1, 2, 132))
    assert table.lookup(key, 128)[0] == "scaled_mm"
    for launch in tune.launches("channel", 1, 4096, 14336, 132, full=False):
        assert launch.split_k == 1 or launch.split_k * triton.cdiv(4096, launch.block_n) <= 8 * 132


def test_the_kernel_bench_runs_on_cpu(tmp_path):
    """bench/quant_kernels.py's code path (interpreted): every output is checked, the layer row sums."""
    import helpers_bench  # noqa: F401 - the repository root on sys.path
    from bench import quant_kernels

    assert quant_kernels.linear_shapes("llama-3.1-8b") == {name: (n, k) for name, (n, k) in LLAMA_8B.items()}
    rows = [quant_kernels.linear_report(name, n, 128, 1, torch.device("cpu"), torch.float32)
            for name, n in (("o", 48), ("down", 80))]
    rows = quant_kernels.with_totals(rows, [1])
    assert [r["linear"] for r in rows] == ["o", "down", "layer"]
    assert rows[2]["triton_us"] == rows[0]["triton_us"] + rows[1]["triton_us"] and rows[2]["scaled_mm_us"] is None
    assert all(r["triton_us"] > 0 and r["block_us"] > 0 and r["floor_us"] > 0 for r in rows)
