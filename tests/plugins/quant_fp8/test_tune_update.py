"""quant_fp8's tuner with --update: the cases tuned now replace their entries of the starting table
(the bundled one of this GPU, or a file), every other entry is kept, and what it writes still parses."""

from __future__ import annotations

import json

import pytest

from backplane.plugins.quant_fp8 import cuda, tune
from backplane.plugins.quant_fp8.kernels import Launch

H100 = "NVIDIA H100 80GB HBM3"


def _entry(kernel, n, k, tokens, block_n=64, **extra):
    key = (kernel, n, k, (128, 128) if kernel == "block" else None)
    return cuda.entry(key, tokens, "triton", Launch(block_n, 128), **extra)


def test_retuned_cases_replace_their_entries_and_the_rest_stay_in_order():
    base = [_entry("channel", 6144, 4096, 1), _entry("block", 6144, 4096, 1), _entry("channel", 6144, 4096, 8)]
    fresh = [_entry("channel", 6144, 4096, 1, block_n=32, us=9.0), _entry("channel", 4096, 4096, 1, us=7.0)]
    out = tune.merged(base, fresh)
    assert [tune.entry_key(e) for e in out] == [tune.entry_key(e) for e in base] + [tune.entry_key(fresh[1])]
    assert out[0]["block_n"] == 32 and out[0]["us"] == 9.0  # replaced in place
    assert out[1] == base[1] and out[2] == base[2]  # the block kernel's entry of the same shape is another case
    assert tune.merged(base, []) == base


def test_update_bundled_starts_from_this_gpus_file(tmp_path):
    bundled = cuda.CONFIG_DIR / cuda.device_file_name(H100)
    if not bundled.exists():
        pytest.skip("no bundled H100 table")
    entries = tune.base_entries("bundled", H100)
    assert entries == json.loads(bundled.read_text())["entries"] and len(entries) > 0
    assert tune.base_entries("bundled", "NVIDIA Nonexistent GPU") == []
    assert tune.base_entries(None, H100) == []
    out = tmp_path / "t.json"
    tune.write(out, H100, True, tune.merged(entries, [_entry("channel", 6144, 4096, 1, block_n=16, gemv=True)]))
    table = cuda.load_table(out)
    assert len(table) == len(entries)  # the case was in the table: replaced, not added
    assert table.lookup(("channel", 6144, 4096, None), 1) == ("triton", Launch(16, 128, gemv=True))


def test_update_from_a_bad_file_is_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"--update .*bad.json is not JSON") as err:
        tune.base_entries(str(bad), H100)
    assert "\n" not in str(err.value)
    assert tune.parse_args(["--out", "x.json", "--update", "bundled"]).update == "bundled"


def test_the_quant_gemv_group_tunes_over_the_bundled_table_then_measures_on_it():
    import helpers_bench  # noqa: F401 - the repository root on sys.path
    from bench import decode, quant_kernels, run

    jobs = {j.name: j for j in run.GROUPS["quant-gemv"]}
    tuned = tune.parse_args(list(jobs["quant-gemv-tune"].argv[2:]))
    assert tuned.update == "bundled" and tuned.tokens == [1, 8] and tuned.out == "{out}/quant_fp8_configs.json"
    kernels = quant_kernels.parse_args(list(jobs["quant-gemv-kernels"].argv[2:]))
    assert kernels.configs == tuned.out and kernels.tokens == [1, 8, 32]
    step = decode.parse_args(list(jobs["quant-gemv-decode"].argv[2:]))
    assert dict(jobs["quant-gemv-decode"].env) == {"BACKPLANE_FP8__CONFIGS": tuned.out} and "fp8" in step.variants
    assert not any(j.together for j in jobs.values())


def test_the_kernel_bench_takes_a_table_and_refuses_a_bad_one(tmp_path):
    import helpers_bench  # noqa: F401
    from bench import quant_kernels

    with pytest.raises(ValueError, match=r"--fp8.configs .*missing.json does not exist"):
        quant_kernels.main(["--tokens", "1", "--configs", str(tmp_path / "missing.json"), "--device", "cpu",
                            "--out", str(tmp_path)])


def test_the_quant_1b_group_reports_issue_39s_rows_at_1b():
    import helpers_bench  # noqa: F401
    from bench import decode, e2e, prefill, quant_kernels, run

    jobs = {j.name: list(j.argv[2:]) for j in run.GROUPS["quant-1b"]}
    weights, kv = decode.parse_args(jobs["quant-decode-1b"]), decode.parse_args(jobs["fp8-kv-1b"])
    assert weights.models == kv.models == ["llama-3.2-1b"] and {"fp8", "fp8-block"} <= set(weights.variants)
    assert "fp8-kv" in kv.variants and kv.context == 16384
    assert decode.result_subject(weights, "llama-3.2-1b") != decode.result_subject(kv, "llama-3.2-1b")
    assert prefill.parse_args(jobs["quant-prefill-1b"]).quantization == ["none", "fp8"]
    both = e2e.parse_args(jobs["quant-e2e-1b"])
    assert both.model == "llama-3.2-1b" and both.kv_cache_dtype == ["auto", "fp8_e4m3"]
    assert quant_kernels.parse_args(jobs["quant-kernels-1b"]).model == "llama-3.2-1b"
