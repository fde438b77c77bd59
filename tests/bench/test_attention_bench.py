"""bench/attention.py on CPU: its command line (--kv-dtype) and the decode sweep's launch settings
for 1- and 2-byte K/V (the kernels themselves need a GPU: bench/run.py group fp8-kv-attn)."""

from __future__ import annotations

import types

import pytest
import torch

from bench import attention


def test_kv_dtype_defaults_to_bf16_and_takes_fp8():
    assert attention.parse_args([]).kv_dtype == "bf16"
    ns = attention.parse_args(["--only", "decode", "--kv-dtype", "fp8_e4m3", "--sweep", "--decode-cases", "8x16384"])
    assert (ns.kv_dtype, ns.sweep, ns.decode_cases) == ("fp8_e4m3", True, ["8x16384"])
    assert attention.KV_DTYPES[ns.kv_dtype] == torch.float8_e4m3fn


@pytest.mark.parametrize("bad", ["fp8", "fp8_e5m2", "float16", ""])
def test_kv_dtype_refuses_other_names(bad, capsys):
    with pytest.raises(SystemExit):
        attention.parse_args(["--kv-dtype", bad])
    assert "--kv-dtype: invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_decode_sweep_settings_by_kv_element_size(monkeypatch, kv_dtype):
    """1-byte K/V sweep 64 to 256 keys a step and 2 to 5 stages, bf16 32 to 128 keys and 2 to 4
    stages, both over half to four times the automatic split count and 2, 4, 8 warps; the fastest wins."""
    tried = []

    def fake_measure(w, kind, case, impl, fn, reference, note=""):
        tried.append(note)
        return {"impl": impl, "us": len(tried) % 7 + 1.0, "note": note}  # any order: the least us wins

    monkeypatch.setattr(attention, "measure", fake_measure)
    monkeypatch.setattr(attention, "triton_decode", lambda w, splits, cfg=None: (splits, cfg))
    w = types.SimpleNamespace(k_buffer=torch.empty(0, dtype=kv_dtype))
    w.kv_fp8 = kv_dtype == torch.float8_e4m3fn
    best = attention.sweep(w, "decode", "bs=8 ctx=16384", None, auto_splits=7)
    settings = {tuple(int(part.split("=")[1]) for part in note.split()) for note in tried}
    splits, block_n, warps, stages = (sorted({s[i] for s in settings}) for i in range(4))
    assert len(settings) == len(tried) == len(splits) * len(block_n) * len(warps) * len(stages)
    assert (splits, warps) == ([3, 7, 14, 28], [2, 4, 8])
    assert (block_n, stages) == (([64, 128, 256], [2, 3, 4, 5]) if w.kv_fp8 else ([32, 64, 128], [2, 3, 4]))
    assert best["us"] == 1.0
