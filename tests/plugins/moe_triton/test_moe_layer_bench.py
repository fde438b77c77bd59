"""bench/moe_layer.py on CPU (kernels interpreted): a tiny smoke run writes its result with every
column, and the peer's two forms (gathered weights, dense) equal the core's layer on torch_native."""

from __future__ import annotations

import json
import os

import pytest
import torch

from helpers_bench import CPU
from bench import moe_layer

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the CPU run of Triton needs TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)")


def test_smoke_run_writes_every_column(tmp_path):
    rows = moe_layer.main(["--shape", "8", "64", "32", "2", "--tokens", "1", "9", "--no-peer", "--out", str(tmp_path), *CPU])
    assert [r["tokens"] for r in rows] == [1, 9]
    assert rows[0]["distinct_experts"] == 2 and rows[1]["distinct_experts"] <= 8
    assert all(r["triton_us"] > 0 and r["native_us"] > 0 and r["floor_us"] > 0 and r["x_native"] for r in rows)
    (path,) = tmp_path.glob("moe-layer-e8-h64-i32-k2-cpu-*.json")
    assert json.loads(path.read_text())["rows"][1]["tokens"] == 9


@pytest.mark.parametrize("dense", [False, True], ids=["gather", "dense"])
def test_peer_equals_the_core_layer(dense):
    torch.manual_seed(0)
    layer, _, native = moe_layer.build_layer((8, 64, 32, 2), torch.device("cpu"), torch.float32, 16)
    x = torch.randn(9, 64)
    torch.testing.assert_close(moe_layer.PeerMoe(layer, dense)(x), moe_layer._on(layer, native)(x), atol=1e-5, rtol=1e-5)


def test_moe_configs_is_the_table_the_triton_layer_reads(tmp_path):
    """--moe-configs PATH: the triton backend reads that table (its launches, not the rule of thumb's),
    the result names it and is kept apart from a run on the bundled table."""
    from backplane.plugins.moe_triton import configs
    from backplane.plugins.moe_triton.gemm import Launch

    shape, launch = (8, 64, 32, 2), Launch(block_n=16, block_k=32, group_m=1, num_warps=2, num_stages=2)
    config = configs.Config(16, launch, launch)
    key = configs.shape_key(torch.float32, 8, 32, 64)
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"tuned": True, "entries": [configs.entry(key, 1, config)]}))
    _, backend, _ = moe_layer.build_layer(shape, torch.device("cpu"), torch.float32, 4, str(table))
    assert backend.table.source == str(table) and backend.launch_config(1, 2, 8, 32, 64, torch.float32) == config
    _, bundled, _ = moe_layer.build_layer(shape, torch.device("cpu"), torch.float32, 4)
    assert len(bundled.table) == 0  # no bundled table off CUDA: the rule of thumb
    rows = moe_layer.main(["--shape", *map(str, shape), "--tokens", "1", "--no-peer", "--moe-configs", str(table),
                           "--out", str(tmp_path), *CPU])
    (path,) = tmp_path.glob("moe-layer-e8-h64-i32-k2-configs-t-cpu-*.json")
    doc = json.loads(path.read_text())
    assert doc["moe_table"] == {"source": str(table), "tuned": True, "entries": 1} and rows[0]["triton_us"] > 0
