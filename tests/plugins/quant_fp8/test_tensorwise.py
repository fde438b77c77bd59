"""quant_fp8's tensor-wise path on CPU (torch._scaled_mm runs there in fp32; Triton's interpreter for
quantize_rows and the scale kernel): torch._scaled_mm with scales of 1 into fp32, then
kernels.scale_rows_columns applies the per-token and per-channel scales and the bias. It gives the
same arithmetic as the Triton channel kernel and stays within FP8 rounding of the reference; a table
entry "use": "tensorwise" sends cuda_linear there for any model dtype (the row-wise "scaled_mm" stays
bf16 only); the tuner times it and keeps it only where it is right and fastest."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from backplane.plugins.quant_fp8 import cuda
from backplane.plugins.quant_fp8 import kernels as qk
from backplane.plugins.quant_fp8.reference import reference_linear
from backplane.plugins.quant_fp8.scheme import Fp8Scheme
from test_decode_kernel import CHANNEL, activations, assert_within, channel_weights, fp8_bound, same_arithmetic

N, K = 72, 208  # N not a multiple of 16: the scale kernel's masked tail


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("m", [1, 5])
def test_tensorwise_matches_the_channel_kernel_and_the_reference(m, with_bias, dtype):
    q_w, s_w = channel_weights(N, K, seed=m)
    x = activations(m, K, seed=m + 10, dtype=dtype)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(3)).to(dtype) if with_bias else None
    got = cuda.tensorwise(CHANNEL, x, q_w, s_w, None, bias)
    assert got.shape == (m, N) and got.dtype == dtype
    kernel = qk.channel_matmul(x, q_w, s_w, bias, qk.Launch(32, 32))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(got, kernel, **tol)
    torch.testing.assert_close(got.float(), same_arithmetic(x, q_w, s_w, bias), **tol)
    assert_within(got, reference_linear(CHANNEL, x.float(), q_w, s_w, None, bias), fp8_bound(x, q_w, s_w, CHANNEL))
    planted = s_w.clone()
    planted[N // 3] *= 1.05  # one channel's scale 5% off
    with pytest.raises(AssertionError):
        torch.testing.assert_close(cuda.tensorwise(CHANNEL, x, q_w, planted, None, bias), kernel, **tol)


def test_tensorwise_with_one_static_activation_scale():
    static = Fp8Scheme(weights="channel", activations="tensor", static_input=True)
    q_w, s_w = channel_weights(N, K, seed=7)
    x = activations(3, K, seed=8)
    scale = torch.tensor(0.02)
    got = cuda.tensorwise(static, x, q_w, s_w, scale, None)
    assert_within(got, reference_linear(static, x, q_w, s_w, scale, None), fp8_bound(x, q_w, s_w, CHANNEL) + 1e-4)


def test_the_scale_kernel_alone_and_its_one_line_error():
    gen = torch.Generator().manual_seed(0)
    acc, sx, sw = torch.randn(4, 40, generator=gen), torch.rand(4, 1, generator=gen), torch.rand(40, 1, generator=gen)
    bias = torch.randn(40, generator=gen)
    got = qk.scale_rows_columns(acc, sx, sw, bias, torch.float32)
    torch.testing.assert_close(got, acc * sx * sw.reshape(1, -1) + bias, rtol=1e-6, atol=1e-6)
    one = qk.scale_rows_columns(acc, torch.tensor(2.0), torch.tensor(0.5), None, torch.float16)
    assert one.dtype == torch.float16 and torch.equal(one, acc.half())
    assert qk.scale_rows_columns(acc[:0], sx[:0], sw, None, torch.float32).shape == (0, 40)
    with pytest.raises(ValueError, match=r"scale_rows_columns: .*x_scale \(3, 1\).*expected fp32 acc") as err:
        qk.scale_rows_columns(acc, sx[:3], sw, None, torch.float32)
    assert "\n" not in str(err.value)


GPU = "Test GPU 80GB"
KEY = ("channel", N, K, None)


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: GPU)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    cuda._choose.cache_clear(), cuda.table_for.cache_clear()
    yield
    cuda._choose.cache_clear(), cuda.table_for.cache_clear()


def test_a_tensorwise_entry_sends_cuda_linear_there_for_every_dtype(tmp_path, monkeypatch, fake_gpu):
    path = tmp_path / "t.json"
    entries = [cuda.entry(KEY, 8, "tensorwise", qk.Launch(32, 32)), cuda.entry(KEY, 64, "scaled_mm", qk.Launch(32, 32))]
    path.write_text(json.dumps({"device": GPU, "tuned": True, "entries": entries}))
    source = cuda.table_source(str(path))
    device = torch.device("cuda", 0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert cuda.choose(KEY, 8, dtype, device, source)[0] == "tensorwise"
    assert cuda.choose(KEY, 64, torch.bfloat16, device, source)[0] == "scaled_mm"
    assert cuda.choose(KEY, 64, torch.float16, device, source)[0] == "triton"  # row-wise: bf16 output only
    taken = []
    monkeypatch.setattr(cuda, "choose", lambda *a, **k: ("tensorwise", qk.Launch(32, 32)))
    monkeypatch.setattr(cuda, "tensorwise", lambda *a: taken.append(a[0]) or a[1].new_zeros(a[1].shape[0], N))
    q_w, s_w = channel_weights(N, K, seed=1)
    cuda.cuda_linear(CHANNEL, activations(2, K, seed=2), q_w, s_w, None, None)
    assert taken == [CHANNEL]


def test_the_tuner_keeps_tensorwise_only_where_it_is_right_and_fastest(monkeypatch):
    from backplane.plugins.quant_fp8 import tune

    q_w, s_w = channel_weights(N, K, seed=5)
    x = activations(1, K, seed=6)

    class FakeCase:
        key, m = KEY, 1

        def run(self, launch):
            return qk.channel_matmul(x, q_w, s_w, None, launch)

        def scaled_mm(self):
            return self.run(qk.Launch(32, 32))

        def tensorwise(self):
            return cuda.tensorwise(CHANNEL, x, q_w, s_w, None, None)

    times = {"tensorwise": 5.0, "scaled_mm": 30.0}
    monkeypatch.setattr(tune, "launches", lambda *a: iter([qk.Launch(32, 32)]))
    monkeypatch.setattr(tune, "cold_graph_us", lambda fn, flush: times.get(getattr(fn, "__name__", ""), 20.0))
    entry = tune.tune_case(FakeCase(), 132, False, None)
    assert entry["use"] == "tensorwise" and entry["tensorwise_us"] == 5.0 and entry["scaled_mm_us"] == 30.0
    times["tensorwise"] = 25.0
    assert tune.tune_case(FakeCase(), 132, False, None)["use"] == "triton"
    monkeypatch.setattr(FakeCase, "tensorwise", lambda self: 2 * self.run(qk.Launch(32, 32)))  # a wrong result
    wrong = tune.tune_case(FakeCase(), 132, False, None)
    assert wrong["use"] == "triton" and "tensorwise_us" not in wrong
