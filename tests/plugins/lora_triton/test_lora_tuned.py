"""The fused kernel's tuned launch table (tuned.py): lookup, bad files, what the backend launches with,
the `--triton-lora.*` options and their errors (docs/reliability.md R73), and the tuner of python -m bench.lora_kernels."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere: run kernels on CPU

import dataclasses  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from test_lora_fused import K, OFFSETS, decode_info, expected, make_ctx, make_weights  # noqa: E402

WIDTHS = [48, 16, 16]


def entry(**over):
    e = {"k": K, "widths": WIDTHS, "block_r": 32, "block_t": 16, "span": 128, "split_k": 2, "num_warps": 2}
    return {**e, **over}


def write_table(path: Path, entries: list[dict]) -> Path:
    path.write_text(json.dumps({"device": "test", "entries": entries}))
    return path


def test_lookup_takes_the_nearest_token_bucket_of_a_measured_shape():
    from backplane.plugins.lora_triton.tuned import Launch, TunedTable

    table = TunedTable.from_json({"entries": [entry(block_t=16, span=128), entry(block_t=64, span=256, split_k=1)]},
                                 "t.json", max_groups=256)
    assert len(table) == 2
    assert table.lookup(K, tuple(WIDTHS), 32, 16) == Launch(128, 2, 2)
    assert table.lookup(K, tuple(WIDTHS), 32, 32) == Launch(128, 2, 2)  # 16 is nearer than 64
    assert table.lookup(K, tuple(WIDTHS), 32, 64) == Launch(256, 1, 2)
    assert table.lookup(K, tuple(WIDTHS), 16, 16) is None  # another rank bucket was never measured
    assert table.lookup(K + 8, tuple(WIDTHS), 32, 16) is None


@pytest.mark.parametrize("content, message", [
    ("[1, 2]", "expected a JSON object with a list \"entries\""),
    (json.dumps({"entries": [{"k": 40}]}), "entry 0 lacks widths, block_r"),
    (json.dumps({"entries": [entry(span=16, split_k=16, widths=[4096])]}), "needs 4096 programs per slot; the kernel holds 256"),
    (json.dumps({"entries": [entry(num_warps=3)]}), "num_warps a power of two"),
    ("{not json", "is not JSON"),
])
def test_a_bad_table_is_one_line_naming_the_file(tmp_path, content, message):
    from backplane.plugins.lora_triton.tuned import load_table

    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match="bad.json") as err:
        load_table(path, max_groups=256)
    assert message in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="does not exist; expected a JSON file written by python -m bench.lora_kernels --tune"):
        load_table(tmp_path / "missing.json", max_groups=256)


def backend_with(options=None, **tuning):
    from backplane.plugins.lora_triton.backend import TritonLoraBackend, Tuning

    return TritonLoraBackend(dataclasses.replace(make_ctx(), options=options), Tuning(**tuning))


def launched_configs(monkeypatch) -> list:
    from backplane.plugins.lora_triton import fused

    configs, original = [], fused.launch

    def spy(*args):
        configs.append(args[-1])
        return original(*args)

    monkeypatch.setattr(fused, "launch", spy)
    return configs


def run_decode(backend, slots):
    info = decode_info(slots)
    backend.prepare_batch(info)
    a, b = make_weights(3)
    x, base = torch.randn(len(slots), K), torch.randn(len(slots), OFFSETS[-1])
    got = backend.apply_lora(x, a, b, OFFSETS, base.clone())
    torch.testing.assert_close(got, expected(info, x, a, b, base), atol=1e-4, rtol=1e-4)


def test_the_backend_launches_with_the_tables_entry_and_stays_exact(tmp_path, monkeypatch):
    from backplane.plugins.lora_triton.fused import FusedConfig
    from backplane.plugins.lora_triton.options import TritonLoraOptions

    path = write_table(tmp_path / "t.json", [entry(span=128, split_k=3, num_warps=2)])
    configs = launched_configs(monkeypatch)
    run_decode(backend_with(TritonLoraOptions(configs=str(path))), [1, 2, 0, 3, 2])
    run_decode(backend_with(TritonLoraOptions(configs=str(path), tuned=False)), [1, 2, 0, 3, 2])
    run_decode(backend_with(TritonLoraOptions(configs=str(path)), fused_config=FusedConfig(split_k=1)), [1, 3])
    assert configs == [FusedConfig(span=128, split_k=3, num_warps=2), FusedConfig(), FusedConfig(split_k=1)]


def test_a_shape_the_table_lacks_falls_back_to_the_read_model(tmp_path, monkeypatch):
    from backplane.plugins.lora_triton.fused import FusedConfig
    from backplane.plugins.lora_triton.options import TritonLoraOptions

    path = write_table(tmp_path / "t.json", [entry(k=K * 2)])
    configs = launched_configs(monkeypatch)
    run_decode(backend_with(TritonLoraOptions(configs=str(path))), [2, 1])
    assert configs == [FusedConfig()]


def test_the_options_group_reaches_the_backend_from_the_settings(tmp_path):
    from backplane.plugin.manager import load_plugins
    from backplane.settings import SettingsError, build_server_args

    groups = load_plugins().settings_groups()
    assert "triton-lora" in groups
    path = write_table(tmp_path / "t.json", [entry()])
    args = build_server_args({"model": "tiny-llama"}, groups, {"triton-lora": {"configs": str(path)}})
    options = args.options_for("triton-lora")
    assert options.configs == str(path) and options.tuned
    assert len(backend_with(options).tuned) == 1
    with pytest.raises(SettingsError, match="triton-lora"):
        build_server_args({"model": "tiny-llama"}, groups, {"triton-lora": {"tuned": "maybe"}})


def test_the_tuner_keeps_the_fastest_checked_setting_per_group(monkeypatch, tmp_path):
    """python -m bench.lora_kernels --tune: every setting runs and is checked; the fastest is written, one
    entry per (shape, rank bucket, token bucket), and the table loads back into the backend."""
    from bench import lora_kernels as bench

    from backplane.plugins.lora_triton.fused import FusedConfig

    timed = []

    def fake_time_us(fn, device, *args, cold=False):  # the setting a timing ran with, from the bench's lambda
        assert cold, "the tuner times each setting with L2 flushed first, as in a model step"
        fn()
        config = fn.__defaults__[-1].tuning.fused_config
        automatic = config == FusedConfig()
        timed.append(None if automatic else config)
        if automatic:
            return 50.0
        return 1.0 if (config.span, config.split_k, config.num_warps) == (256, 2, 4) else 10.0 + config.split_k

    monkeypatch.setattr(bench, "time_us", fake_time_us)
    table = bench.tune_fused("tiny-llama", [8], [1, 3], 2, torch.device("cpu"),
                             spans=(128, 256), splits=(1, 2), warps=(2, 4))
    entries = table["entries"]
    assert {e["group"] for e in entries} == {"qkv", "o", "gate_up", "down"}
    assert len(entries) == 4 and all(e["tokens"] == 3 for e in entries)  # T 1 and 3 share block_t 16
    from backplane.plugins.lora_triton.fused import MIN_SPLIT_K

    for e in entries:  # a K too short to split (tiny-llama's 256 but down's) keeps split_k 1: the first, fastest
        splits = e["k"] // 2 >= MIN_SPLIT_K
        want = (256, 2, 4, 1.0) if splits else (128, 1, 2, 11.0)
        assert (e["span"], e["split_k"], e["num_warps"], e["us"], e["automatic_us"]) == (*want, 50.0), e["group"]
    assert any(e["split_k"] == 2 for e in entries)
    settings = sum(8 if e["k"] // 2 >= MIN_SPLIT_K else 4 for e in entries)
    assert len([c for c in timed if c is not None]) == 2 * settings  # both token counts, every allowed setting
    from backplane.plugins.lora_triton.options import TritonLoraOptions

    path = tmp_path / "tuned.json"
    path.write_text(json.dumps(table))
    tuned = backend_with(TritonLoraOptions(configs=str(path))).tuned
    down = next(e for e in entries if e["group"] == "down")
    assert tuned.lookup(down["k"], tuple(down["widths"]), 16, 16).split_k == 2


@pytest.mark.parametrize("content", [None, "{not json", json.dumps({"entries": [{"k": 40}]})])
def test_a_bad_table_stops_the_cli_with_one_line(tmp_path, capsys, content):  # R73
    from bench.workload import write_dummy_adapter

    from backplane.cli import main
    from backplane.models.presets import get_preset

    write_dummy_adapter(tmp_path / "a", get_preset("tiny-llama"), 8, seed=0)
    table = tmp_path / "table.json"
    if content is not None:
        table.write_text(content)
    argv = ["generate", "--model", "tiny-llama", "--device", "cpu", "--lora-backend", "triton",
            "--lora-paths", f"a={tmp_path / 'a'}", "--triton-lora.configs", str(table), "--max-new-tokens", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("backplane: error: triton-lora.configs: ") or \
        err.startswith(f"backplane: error: {table}: "), err
    assert str(table) in err and err.rstrip().endswith("(plugin 'lora_triton': LoRA backend 'triton')")
