"""The moe_triton plugin as installed: its spec, `auto` choosing it on CUDA for a graph run (and
refusing it on CPU in one line), its settings group, and the tuner's --defaults table."""

from __future__ import annotations

import pytest
import torch

from backplane.plugin.manager import load_plugins
from backplane.plugin.selection import MoeRequirements, SelectionError, select_moe_backend


@pytest.fixture(scope="module")
def registry():
    return load_plugins(only=["moe_triton"]).registry


def test_spec(registry):
    spec = registry.specs("moe")["triton"]
    assert spec.platforms == ("cuda",) and set(spec.dtypes) == {"bfloat16", "float16", "float32"}
    assert spec.supports_graph and spec.supports_compile and spec.priority == 10 and spec.quant_methods == ("fp8",)
    assert registry.options_group("moe_triton") == "triton-moe"


def test_available_says_why(registry, monkeypatch):
    spec = registry.specs("moe")["triton"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert spec.available() == "no CUDA device"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert spec.available() is None


def test_auto_picks_it_on_cuda_for_graphs(registry, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    req = MoeRequirements(platform="cuda", dtype="bfloat16", num_experts=128, top_k=8, graphs=True, compile=True)
    assert select_moe_backend(registry, "auto", req).spec.name == "triton"
    with pytest.raises(SelectionError, match=r"2048 experts above its maximum 1024"):
        select_moe_backend(registry, "triton", MoeRequirements("cuda", "bfloat16", num_experts=2048, top_k=8))
    fp8 = MoeRequirements("cuda", "bfloat16", num_experts=8, top_k=2, quant="fp8", graphs=True)
    assert select_moe_backend(registry, "auto", fp8).spec.name == "triton"  # FP8 experts under graphs
    with pytest.raises(SelectionError, match=r"expert weights quantized by 'int4' not supported \(supports: fp8"):
        select_moe_backend(registry, "triton", MoeRequirements("cuda", "bfloat16", num_experts=8, top_k=2, quant="int4"))


def test_cpu_is_refused_in_one_line(registry):
    with pytest.raises(SelectionError, match=r"--moe-backend triton .*platform 'cpu' not supported \(supports: cuda\)"):
        select_moe_backend(registry, "triton", MoeRequirements("cpu", "float32", num_experts=8, top_k=2))


def test_tuner_defaults_table(tmp_path):
    from backplane.plugins.moe_triton import configs, tune

    out = tmp_path / "t.json"
    tune.main(["--defaults", "--device-name", "NVIDIA X1", "--shapes", "8,64,32,2", "--tokens", "1", "64", "--out", str(out)])
    table = configs.load_table(out)
    key = configs.shape_key(torch.bfloat16, 8, 32, 64)
    assert not table.tuned and sorted(table.entries[key]) == [1, 64]
    assert table.lookup(key, 64) == configs.default_config(64, 2, 8, torch.bfloat16)
    with pytest.raises(SystemExit, match="expected E,H,I,k"):
        tune.Shape.parse("big")
