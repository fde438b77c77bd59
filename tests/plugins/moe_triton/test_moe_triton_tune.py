"""The tuner's search (plugins/moe_triton/tune.py): at block height 16 (decode sizes) the launches
it can reach cover narrow tiles, deep K steps, 2-8 warps and 2-5 stages; the coordinate-wise search
finds a separable cost's minimum, measures each launch once and never one over the shared memory;
the budget stops measuring. On the GPU: a quick run writes a tuned table the backend reads."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from backplane.plugins.moe_triton import configs, tune
from backplane.plugins.moe_triton.gemm import Launch

DEFAULT = Launch(block_n=32, block_k=128, group_m=1, num_warps=4, num_stages=4)  # the rule of thumb's gate_up at 1 token


def test_the_decode_space_holds_what_a_one_pair_per_expert_gemm_needs():
    axes = tune.DECODE_AXES
    assert {16, 32} <= set(axes["block_n"]) and {256, 512} <= set(axes["block_k"])
    assert set(axes["num_warps"]) == {2, 4, 8} and set(axes["num_stages"]) == {2, 3, 4, 5}
    full = list(tune.launches(16, 2, 2, full=True))  # --full: the whole product, shared memory allowing
    assert Launch(16, 512, 1, 2, 4) in full and Launch(16, 512, 1, 2, 5) not in full  # 5 x 48 KiB tiles
    assert all(tune.fits(launch, 16, 2, 2) for launch in full) and len(full) < 4 * 4 * 3 * 4
    taller = list(tune.launches(64, 1, 2, full=False))  # taller blocks: as before
    assert {launch.group_m for launch in taller} == {8} and {launch.num_warps for launch in taller} == {4, 8}


def _cost(launch: Launch) -> float:
    """A separable cost with its minimum at block_n 16, block_k 512, 2 warps, 3 stages."""
    return (abs(math.log2(launch.block_n / 16)) + abs(math.log2(launch.block_k / 512)) +
            abs(math.log2(launch.num_warps / 2)) + abs(launch.num_stages - 3) + 1.0)


def test_local_search_finds_the_minimum_measuring_each_launch_once():
    measured = []

    def measure(launch):
        measured.append(launch)
        return _cost(launch)

    us, best = tune.local_search(measure, DEFAULT, tune.DECODE_AXES, lambda launch: True)
    assert best == Launch(16, 512, 1, 2, 3) and us == 1.0
    assert len(measured) == len(set(measured)) and DEFAULT in measured
    assert len(measured) <= 1 + tune.MAX_PASSES * sum(len(v) for v in tune.DECODE_AXES.values())


def test_local_search_skips_launches_that_do_not_fit_and_failures():
    measured = []

    def measure(launch):
        measured.append(launch)
        return math.inf if launch.num_warps == 2 else _cost(launch)  # 2 warps: refused by the compiler

    def fit(launch):
        return tune.fits(launch, 16, 2, 2)

    us, best = tune.local_search(measure, DEFAULT, tune.DECODE_AXES, fit)
    assert all(fit(launch) for launch in measured if launch != DEFAULT)
    assert best.num_warps == 4 and fit(best) and us == _cost(best)
    assert not any(fit(launch) and _cost(launch) < us for launch in measured if launch.num_warps != 2)


def test_past_the_deadline_nothing_is_launched():
    launched = []

    def gemm_fn(block_m, num_blocks, launch):
        launched.append(launch)  # NOTE: not raising: _measure takes an exception for a refused launch
        return torch.zeros(2, 2)

    want, past = torch.zeros(2, 2), time.monotonic() - 1
    assert tune._measure(gemm_fn, 16, 1, want, None, past, DEFAULT) == math.inf
    assert tune._best(gemm_fn, 16, 1, 2, False, want, None, DEFAULT, past) == (math.inf, DEFAULT)
    assert tune._best(gemm_fn, 32, 1, 2, False, want, None, DEFAULT, past) == (math.inf, DEFAULT)
    assert launched == []


def test_the_quick_invocation_parses_to_the_decode_token_counts():
    ns = tune.parse_args(["--shapes", "qwen3-30b-a3b", "--tokens", *map(str, tune.DECODE_TOKENS), "--budget", "150",
                          "--out", "t.json"])
    assert tuple(ns.tokens) == tune.DECODE_TOKENS == (1, 2, 4, 8, 16, 32) and ns.shapes == ["qwen3-30b-a3b"]
    assert "--tokens 1 2 4 8 16 32" in tune.__doc__


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_a_quick_run_writes_a_tuned_table_no_slower_than_the_rule_of_thumb(tmp_path):
    out = tmp_path / "t.json"
    tune.main(["--shapes", "16,256,128,2", "--tokens", "1", "4", "--budget", "60", "--out", str(out)])
    entries = json.loads(out.read_text())["entries"]
    assert [e["tokens"] for e in entries] == [1, 4] and all(e["block_m"] == 16 for e in entries)
    assert all(e["us"] <= 1.15 * e["default_us"] for e in entries), entries  # the search starts at the rule of thumb
    table = configs.load_table(out)
    assert table.tuned and table.lookup(configs.shape_key(torch.bfloat16, 16, 128, 256), 1) is not None
