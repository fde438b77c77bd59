"""bench/lora.py and bench/spec.py on CPU: the LoRA read floors the GPU tables quote, the variants
of a LoRA run, and speculation's construction (a draft that reproduces its target) accepting every draft."""

from __future__ import annotations

import pytest

from helpers_bench import CPU
from bench import lora, spec


@pytest.mark.parametrize("rank, bs, folded, want", [(16, 1, True, 1.039), (64, 1, True, 1.155), (16, 8, False, 1.073),
                                                     (64, 32, True, 1.292)])
def test_read_floors_of_llama_3_2_1b_with_8_adapters(rank, bs, folded, want):
    assert lora.read_floor_ratio("llama-3.2-1b", rank, bs, 8, folded) == pytest.approx(want, abs=5e-4)


def test_a_lora_run_times_base_lora_off_and_lora_on_side_by_side(tmp_path):
    rows = lora.main(["--model", "tiny-llama", "--lora-backend", "torch_native", "--paths", "fused", "--batch-sizes", "1",
                      "3", "--ranks", "8", "--adapters", "2", "--steps", "2", "--input-len", "8", "--rounds", "1",
                      "--out", str(tmp_path), *CPU])
    assert [(r["batch_size"], r["variant"]) for r in rows] == [(b, v) for b in (1, 3) for v in ("base", "lora-off", "lora-r8")]
    assert all(r["x_base"] == r["step_ms"] / rows[3 * (r["batch_size"] == 3)]["step_ms"] for r in rows)
    assert rows[2]["verdict"] == "n/a (not a GPU run)" and "read_floor_x" in rows[2] and "read_floor_x" not in rows[1]


def test_the_reproducing_draft_is_accepted_whole(tmp_path):
    result = spec.main(["--model", "tiny-llama", "--backend", "torch_native", "--new-tokens", "16", "--token-map", "300",
                        "--verify-batch-sizes", "1", "--out", str(tmp_path), *CPU])
    runs = {r["run"]: r for r in result["batch1"]}
    assert runs["plain"]["acceptance_length"] is None and runs["plain"]["speedup"] == 1.0
    assert runs["eagle"]["acceptance_length"] == runs["eagle, token map 300"]["acceptance_length"] == spec.NUM_DRAFT
    assert result["verify_vs_decode"][0]["ratio"] > 0 and result["draft_graph_memory"] is None
