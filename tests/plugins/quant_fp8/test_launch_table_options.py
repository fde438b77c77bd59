"""`--fp8.configs PATH` and `--fp8.tuned`: which launch table cuda.py chooses from, read at make_config.

No GPU: the device cuda.choose asks about is faked (its name, so no bundled table matches unless a test
bundles one, and its SM count), and the choice caches are emptied around each test so that a fake
device never serves a real GPU's later choice.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from backplane.contracts import QuantContext
from backplane.plugins.quant_fp8 import cuda
from backplane.plugins.quant_fp8 import kernels as qk
from backplane.plugins.quant_fp8.config import make_config
from backplane.plugins.quant_fp8.method import Fp8LinearMethod
from backplane.plugins.quant_fp8.opaque import fp8_linear, scheme_key
from backplane.plugins.quant_fp8.options import BUNDLED, Fp8Options
from backplane.plugins.quant_fp8.scheme import Fp8Scheme

GPU = "Test GPU 80GB"
SMS = 132
KEY = ("channel", 6144, 4096, None)
DEVICE = torch.device("cuda", 0)
TABLE_A = qk.Launch(block_n=32, block_k=64, split_k=2, num_warps=2, num_stages=2)
TABLE_B = qk.Launch(block_n=256, block_k=32, split_k=1, num_warps=8, num_stages=5)


@pytest.fixture(autouse=True)
def fake_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: GPU)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(multi_processor_count=SMS))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    cuda._choose.cache_clear(), cuda.table_for.cache_clear()
    yield
    cuda._choose.cache_clear(), cuda.table_for.cache_clear()


def _write(path, launch, use="triton", tokens=8):
    path.write_text(json.dumps({"device": GPU, "tuned": True, "entries": [cuda.entry(KEY, tokens, use, launch)]}))
    return path


def _config(**options):
    return make_config(QuantContext(None, torch.bfloat16, torch.device("cpu"), options=Fp8Options(**options)))


def _chosen(table=None, m=8, dtype=torch.bfloat16):
    return cuda.choose(KEY, m, dtype, DEVICE) if table is None else cuda.choose(KEY, m, dtype, DEVICE, table)


def _default(m=8, dtype=torch.bfloat16):
    return cuda.default_launch(KEY, m, torch.empty((), dtype=dtype).element_size(), SMS)


def test_a_configured_table_is_the_one_chosen_from(tmp_path):
    assert _default() not in (TABLE_A, TABLE_B)
    table = _config(configs=str(_write(tmp_path / "a.json", TABLE_A))).table
    assert table.configs == str((tmp_path / "a.json").resolve()) and table.tuned
    assert _chosen(table) == ("triton", TABLE_A)
    assert _chosen(table, m=13) == ("triton", TABLE_A)  # the same bucket (16)
    assert _chosen(table, m=40) == ("triton", _default(40))  # another bucket: the rule of thumb
    assert _chosen() == ("triton", _default())  # the old signature: the bundled table (none for this GPU)
    scaled = _config(configs=str(_write(tmp_path / "s.json", TABLE_A, use="scaled_mm"))).table
    assert _chosen(scaled) == ("scaled_mm", TABLE_A)
    assert _chosen(scaled, dtype=torch.float16) == ("triton", TABLE_A)  # _scaled_mm row-wise is bf16 only


def test_tuned_false_ignores_even_the_bundled_table(tmp_path, monkeypatch):
    monkeypatch.setattr(cuda, "CONFIG_DIR", tmp_path)
    _write(tmp_path / cuda.device_file_name(GPU), TABLE_B)
    assert _config().table == BUNDLED and _chosen(_config().table) == ("triton", TABLE_B)
    untuned = _config(tuned=False).table
    assert not untuned.tuned and _chosen(untuned) == ("triton", _default())
    configured_untuned = _config(configs=str(_write(tmp_path / "a.json", TABLE_A)), tuned=False).table
    assert _chosen(configured_untuned) == ("triton", _default())
    assert _chosen() == ("triton", TABLE_B)  # still the bundled one for the old signature


@pytest.mark.parametrize("content, says", [
    (None, r"does not exist; expected a JSON launch table written by python -m backplane.plugins.quant_fp8.tune"),
    ("{not json", r"is not JSON \(.*\); expected a JSON launch table"),
    ("[1, 2]", r"expected a JSON object with a list \"entries\", got list"),
    (json.dumps({"entries": [{"kernel": "channel"}]}), r"entry 0 lacks N, K, tokens, use"),
    ("dir", r"cannot be read \(.*\); expected a JSON launch table"),
])
@pytest.mark.parametrize("tuned", [True, False])
def test_a_bad_configs_path_is_refused_at_make_config(tmp_path, content, says, tuned):
    path = tmp_path / "table.json"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=rf"^--fp8.configs {path}.*{says}") as err:
        _config(configs=str(path), tuned=tuned)
    message = str(err.value)
    assert "\n" not in message and message.endswith(
        "fix: point --fp8.configs at a file tune.py wrote, or leave it unset for the GPU's bundled table")


def test_two_configs_in_one_process_keep_their_own_tables(tmp_path):
    first = _config(configs=str(_write(tmp_path / "a.json", TABLE_A)))
    second = _config(configs=str(_write(tmp_path / "b.json", TABLE_B)))
    untuned = _config(tuned=False)
    for _ in range(2):  # the second round comes from the caches
        assert _chosen(first.table) == ("triton", TABLE_A) and _chosen(second.table) == ("triton", TABLE_B)
        assert _chosen(untuned.table) == _chosen() == ("triton", _default())
    methods = [config.method_for(None, "model.layers.0.mlp.down_proj") for config in (first, second, untuned)]
    assert [m.table for m in methods] == [first.table, second.table, untuned.table]
    keys = {scheme_key(m.scheme, m.table) for m in methods}
    assert len(keys) == 3 and scheme_key(methods[0].scheme) == repr(methods[0].scheme)  # bundled: the old key


def test_a_table_rewritten_in_place_is_read_again_by_the_next_engine(tmp_path):
    path = _write(tmp_path / "t.json", TABLE_A)
    before = _config(configs=str(path)).table
    assert _chosen(before) == ("triton", TABLE_A)
    _write(path, TABLE_B)
    os.utime(path, ns=(before.stamp + 10**9, before.stamp + 10**9))  # a coarse clock may not move
    after = _config(configs=str(path)).table
    assert _chosen(after) == ("triton", TABLE_B) and _chosen(before) == ("triton", TABLE_A)


def test_the_method_and_the_opaque_op_hand_the_table_to_cuda_linear(tmp_path, monkeypatch):
    seen = []

    def fake_cuda_linear(scheme, x, weight, weight_scale, input_scale, bias, counters=None, source=BUNDLED):
        seen.append((scheme, source))
        return x.new_zeros(x.shape[0], weight.shape[0])

    monkeypatch.setattr(cuda, "cuda_linear", fake_cuda_linear)
    table = _config(configs=str(_write(tmp_path / "a.json", TABLE_A))).table
    scheme = Fp8Scheme(weights="channel", activations="token")
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.zeros(48, 32).to(torch.float8_e4m3fn), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(torch.ones(48, 1), requires_grad=False)
    method = Fp8LinearMethod(scheme, "layer", table)
    method.use_cuda, method.counters = True, None  # as on a GPU
    x = torch.randn(3, 32)
    method.apply(layer, x, None)
    fp8_linear(x, layer.weight, layer.weight_scale, None, None, None, scheme_key(scheme, table))
    fp8_linear(x, layer.weight, layer.weight_scale, None, None, None, scheme_key(scheme))
    assert seen == [(scheme, table), (scheme, table), (scheme, BUNDLED)]


def test_the_options_parse_from_the_command_line_and_the_environment(tmp_path, monkeypatch):
    from backplane.cli import parse_server_args
    from backplane.plugin.manager import load_plugins

    plugin_set = load_plugins()
    args = parse_server_args(["--fp8.configs", str(tmp_path / "t.json"), "--no-fp8.tuned"], plugin_set)
    options = args.options_for("fp8")
    assert options.configs == str(tmp_path / "t.json") and options.tuned is False
    assert parse_server_args([], plugin_set).options_for("fp8") == Fp8Options()
    monkeypatch.setenv("BACKPLANE_FP8__TUNED", "false")
    assert parse_server_args([], plugin_set).options_for("fp8").tuned is False


def test_the_engine_carries_the_table_to_every_layer_and_refuses_a_bad_one_at_build(tmp_path):
    from helpers_models import make_hf_model, tiny_hf_config

    from backplane import Engine

    make_hf_model(tiny_hf_config("LlamaForCausalLM"), seed=3).save_pretrained(tmp_path / "model")
    cpu = dict(device="cpu", dtype="float32", max_total_tokens=512, quantization="fp8")
    table = _write(tmp_path / "a.json", TABLE_A)
    engine = Engine(str(tmp_path / "model"), **cpu, plugin_options={"fp8": {"configs": str(table), "tuned": False}})
    try:
        methods = [m.quant_method for m in engine.runner.model.modules() if getattr(m, "quant_method", None)]
        assert methods and {m.table for m in methods} == {cuda.TableSource(str(table.resolve()), False,
                                                                           table.stat().st_mtime_ns)}
    finally:
        engine.shutdown()
    with pytest.raises(Exception, match=rf"^--fp8.configs {tmp_path}/missing.json does not exist; ") as err:
        Engine(str(tmp_path / "model"), **cpu, plugin_options={"fp8": {"configs": str(tmp_path / "missing.json")}})
    assert "\n" not in str(err.value)
