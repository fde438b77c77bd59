"""quant_fp8's GEMV launches (Launch.gemv, M up to kernels.GEMV_MAX_ROWS, no tl.dot) on CPU, in
Triton's interpreter (fp32 and fp16 x): channel_matmul and block_matmul against the same arithmetic
in torch, the dequantized reference and the tl.dot kernels, at odd N and K, split K, with and
without bias; planted scale errors fail. And the field in cuda.py's table (old tables without it
parse as before) and in tune.py's search space."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from backplane.plugins.quant_fp8 import cuda
from backplane.plugins.quant_fp8 import kernels as qk
from backplane.plugins.quant_fp8 import quantize as fq
from backplane.plugins.quant_fp8 import tune
from backplane.plugins.quant_fp8.reference import reference_linear
from test_decode_kernel import (BLOCK, BLOCKWISE, CHANNEL, activations, assert_within, channel_weights, fp8_bound,
                                same_arithmetic)

N, K = 72, 200  # N not a multiple of BLOCK_N (32), K not one of BLOCK_K (32): 7 K steps


def _no_dot_kernel(monkeypatch):
    """The tl.dot kernels made unusable: a GEMV launch must not reach them."""
    for name in ("_channel_kernel", "_block_kernel"):
        monkeypatch.setattr(qk, name, None)


@pytest.mark.parametrize("stages", [1, 3])  # 1: x and w loaded in each step; more: both prefetched a step ahead
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_channel_gemv_matches_the_reference_and_the_dot_kernel(m, fuse, split, with_bias, stages, monkeypatch):
    q_w, s_w = channel_weights(N, K, seed=m)
    x = activations(m, K, seed=m + 1)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(m)) if with_bias else None
    launch = qk.Launch(block_n=32, block_k=32, split_k=split, num_stages=stages, fuse_quant=fuse, gemv=True)
    dot = qk.channel_matmul(x, q_w, s_w, bias, dataclasses.replace(launch, gemv=False))
    counters = qk.new_counters(q_w)
    _no_dot_kernel(monkeypatch)
    got = qk.channel_matmul(x, q_w, s_w, bias, launch, counters)
    assert got.shape == (m, N) and got.dtype == x.dtype and counters.abs().sum() == 0
    torch.testing.assert_close(got, same_arithmetic(x, q_w, s_w, bias), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, dot, rtol=1e-5, atol=1e-5)
    assert_within(got, reference_linear(CHANNEL, x, q_w, s_w, None, bias), fp8_bound(x, q_w, s_w, CHANNEL))
    planted = s_w.clone()
    planted[N // 3] *= 1.05  # one channel's scale 5% off
    with pytest.raises(AssertionError):
        assert_within(got, reference_linear(CHANNEL, x, q_w, planted, None, bias), fp8_bound(x, q_w, s_w, CHANNEL))


def test_channel_gemv_wide_tiles_fp16_and_per_tensor_scales(monkeypatch):
    """fp16 x and output; a K step wider than K (one masked step); an fp8 x with one static scale
    and a per-tensor weight scale (both broadcast)."""
    q_w, s_w = channel_weights(N, K, seed=4)
    x = activations(5, K, seed=5, dtype=torch.float16)
    _no_dot_kernel(monkeypatch)
    got = qk.channel_matmul(x, q_w, s_w, None, qk.Launch(64, 256, fuse_quant=True, gemv=True))
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), same_arithmetic(x, q_w, s_w), rtol=1e-3, atol=1e-3)
    q_t, s_t = fq.quantize_per_tensor(torch.randn(N, K) * 0.05)
    q_x, s_x = fq.quantize_per_tensor(x.float(), torch.tensor(0.02))
    got = qk.channel_matmul(q_x, q_t, s_t, None, qk.Launch(16, 64, split_k=2, gemv=True), x_scale=s_x,
                            out_dtype=torch.float32)
    torch.testing.assert_close(got, (q_x.float() * s_x) @ (q_t.float() * s_t).t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fuse, split, with_bias", [(True, 1, False), (False, 1, True), (True, 3, True),
                                                    (False, 2, False)])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_block_gemv_matches_the_reference_and_the_dot_kernel(m, fuse, split, with_bias, monkeypatch):
    n, k = 50, 96  # N ends inside a weight block and a column tile
    gen = torch.Generator().manual_seed(m)
    q_w, s_w = fq.quantize_weight_blocks(torch.randn(n, k, generator=gen) * 0.05, *BLOCK)
    x = activations(m, k, seed=m + 2)
    bias = torch.randn(n, generator=gen) if with_bias else None
    launch = qk.Launch(block_n=32, block_k=16, split_k=split, fuse_quant=fuse, gemv=True)
    dot = qk.block_matmul(x, q_w, s_w, BLOCK, bias, dataclasses.replace(launch, gemv=False))
    _no_dot_kernel(monkeypatch)
    got = qk.block_matmul(x, q_w, s_w, BLOCK, bias, launch)
    torch.testing.assert_close(got, same_arithmetic(x, q_w, s_w, bias, BLOCK[1], BLOCK), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, dot, rtol=1e-5, atol=1e-5)
    assert_within(got, reference_linear(BLOCKWISE, x, q_w, s_w, None, bias), fp8_bound(x, q_w, s_w, BLOCKWISE))
    planted = s_w.clone()
    planted[1, 2] *= 1.25  # one weight block's scale off
    with pytest.raises(AssertionError):
        assert_within(got, reference_linear(BLOCKWISE, x, q_w, planted, None, bias), fp8_bound(x, q_w, s_w, BLOCKWISE))


def test_a_gemv_launch_past_its_rows_is_a_one_line_error():
    q_w, s_w = channel_weights(40, 64, seed=1)
    x = activations(qk.GEMV_MAX_ROWS + 1, 64, seed=2)
    launch = qk.Launch(32, 32, gemv=True)
    with pytest.raises(ValueError, match=r"^channel_matmul: Launch\(.*gemv=True\) is a GEMV launch, for M up to 8 "
                                         r"rows; got M = 9: expected gemv=False"):
        qk.channel_matmul(x, q_w, s_w, None, launch)
    with pytest.raises(ValueError, match=r"^block_matmul: .* for M up to 8 rows; got M = 9"):
        qk.block_matmul(x, *fq.quantize_weight_blocks(torch.randn(40, 64), *BLOCK), BLOCK, None, launch)
    assert qk.Launch(32, 32).gemv is False


# -- the table and the tuner ------------------------------------------------------------------------

KEY = ("channel", 6144, 4096, None)
GEMV = qk.Launch(32, 256, split_k=2, num_warps=8, num_stages=2, fuse_quant=True, gemv=True)
DOT = qk.Launch(64, 256, split_k=3, fuse_quant=True)


def _table(tmp_path, entries):
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"device": "test", "tuned": True, "entries": entries}))
    return cuda.load_table(path)


def test_a_gemv_entry_round_trips_and_an_old_entry_is_not_gemv(tmp_path):
    written = cuda.entry(KEY, 1, "triton", GEMV, us=9.0)
    assert written["gemv"] is True
    old = {name: value for name, value in cuda.entry(KEY, 8, "triton", DOT).items() if name != "gemv"}
    table = _table(tmp_path, [written, old])
    assert table.lookup(KEY, 1) == ("triton", GEMV)
    assert table.lookup(KEY, 8) == ("triton", DOT) and table.lookup(KEY, 8)[1].gemv is False
    assert cuda.entry(KEY, 1, "triton", table.lookup(KEY, 1)[1], us=9.0) == written


def test_the_bundled_table_without_the_field_parses_as_dot_launches():
    paths = sorted(cuda.CONFIG_DIR.glob("*.json"))
    if not paths:
        pytest.skip("no bundled launch table")
    for path in paths:
        entries = json.loads(path.read_text())["entries"]
        table = cuda.load_table(path)
        for e in entries:
            key = (e["kernel"], e["N"], e["K"], tuple(e["block"]) if "block" in e else None)
            assert table.entries[key][e["tokens"]][1].gemv is e.get("gemv", False)


def test_a_gemv_entry_serves_only_m_up_to_its_limit(tmp_path):
    """Bucket 16 holds M 1 to 16: M 9 to 11 are nearest the 8-token entry, but a GEMV launch cannot
    serve them, so they take the bucket's other entry (or the defaults when it has none)."""
    table = _table(tmp_path, [cuda.entry(KEY, 8, "triton", GEMV), cuda.entry(KEY, 16, "triton", DOT)])
    assert table.lookup(KEY, 8) == ("triton", GEMV) and table.lookup(KEY, 5) == ("triton", GEMV)
    assert table.lookup(KEY, 9) == ("triton", DOT) and table.lookup(KEY, 11) == ("triton", DOT)
    only = _table(tmp_path, [cuda.entry(KEY, 8, "triton", GEMV)])
    assert only.lookup(KEY, 8) == ("triton", GEMV) and only.lookup(KEY, 9) is None


@pytest.mark.parametrize("change, message", [
    ({"gemv": "yes"}, r"entry 0: gemv 'yes' at tokens 1: expected true or false \(false when absent\)"),
    ({"gemv": True, "tokens": 16}, r"entry 0: gemv True at tokens 16: .*true only up to 8 tokens"),
])
def test_a_bad_gemv_field_is_one_line(tmp_path, change, message):
    good = cuda.entry(KEY, 1, "triton", DOT)
    with pytest.raises(ValueError, match=message) as err:
        _table(tmp_path, [{**good, **change}])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kernel", ["channel", "block"])
def test_the_decode_search_space_tries_gemv_launches_up_to_8_rows(kernel):
    n, k = 4096, 14336
    for m in (1, 8):
        space = list(tune.launches(kernel, m, n, k, 132, full=False))
        gemv = [launch for launch in space if launch.gemv]
        assert gemv and [launch for launch in space if not launch.gemv] == list(tune._dot_launches(kernel, m, n, k, 132,
                                                                                                   False))
        assert {launch.block_n for launch in gemv} == {16, 32, 64, 128} and {launch.num_warps for launch in gemv} == {4, 8}
        assert {launch.block_k for launch in gemv} == ({128, 256, 512} if kernel == "channel" else {tune.BLOCK[1]})
        assert {launch.split_k for launch in gemv} >= {1, 2, 4}
        assert all(16 <= g.block_n * g.block_k // (32 * g.num_warps) <= 128 for g in gemv)
        assert {g.num_stages for g in gemv} == {1, 2}
        assert all(g.block_n * g.block_k // (32 * g.num_warps) <= 64 for g in gemv if g.num_stages > 1)
        assert all(132 <= g.split_k * -(-n // g.block_n) and (g.split_k == 1 or g.split_k * -(-n // g.block_n) <= 8 * 132)
                   for g in gemv)
    assert not any(launch.gemv for m in (9, 32) for launch in tune.launches(kernel, m, n, k, 132, full=False))
    full = list(tune.gemv_launches(kernel, 1, n, k, 132, full=True))
    assert {g.num_stages for g in full} == {1, 2} and {g.fuse_quant for g in full} == {False, True}


class _FakeCase:
    """tune.Case on the CPU (fp32 x, interpreted kernels); `last` is the launch its latest run took."""

    def __init__(self, m: int):
        self.key, self.m, self.last = ("channel", 40, 64, None), m, None
        self.weight, self.scale = channel_weights(40, 64, seed=m)
        self.x = activations(m, 64, seed=m + 1)

    def run(self, launch):
        self.last = launch
        y = qk.channel_matmul(self.x, self.weight, self.scale, None, launch)
        return y * 1.5 if launch.block_n == 16 else y  # a planted wrong launch

    def scaled_mm(self):
        self.last = None
        return reference_linear(CHANNEL, self.x, self.weight, self.scale, None, None)

    tensorwise = scaled_mm  # timed as _scaled_mm (20 µs): never the fastest here


def test_the_tuner_keeps_a_faster_gemv_launch_and_records_both_kinds(monkeypatch):
    cases = [_FakeCase(m=3), _FakeCase(m=16)]
    space = [qk.Launch(32, 32), qk.Launch(32, 32, gemv=True), qk.Launch(16, 32, gemv=True)]
    monkeypatch.setattr(tune, "launches", lambda *args: iter(space))

    def timed(fn, flush):  # µs: GEMV 5, the wrong GEMV 1 (it must be dropped), tl.dot 9, _scaled_mm 20
        fn()
        last = cases[0].last
        return 20.0 if last is None else (1.0 if last.block_n == 16 else 5.0 if last.gemv else 9.0)

    monkeypatch.setattr(tune, "cold_graph_us", timed)
    entry = tune.tune_case(cases[0], num_sms=132, full=False, flush=None)
    assert entry["gemv"] is True and entry["block_n"] == 32 and entry["use"] == "triton"
    assert (entry["us"], entry["dot_us"], entry["gemv_us"], entry["scaled_mm_us"]) == (5.0, 9.0, 5.0, 20.0)
    cases.pop(0)  # 16 tokens: no GEMV launch, no GEMV timing
    monkeypatch.setattr(tune, "launches", lambda *args: iter(space[:1]))
    entry = tune.tune_case(cases[0], num_sms=132, full=False, flush=None)
    assert entry["gemv"] is False and "gemv_us" not in entry and entry["us"] == 9.0
