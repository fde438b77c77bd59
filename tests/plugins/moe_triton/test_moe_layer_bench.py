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
