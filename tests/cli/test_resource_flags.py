"""Resource flags are bounded and named, plugin options are named, `--json` never holds NaN, and
Ctrl-C ends the command with one line and exit code 130 (docs/reliability.md R62-R65)."""

from __future__ import annotations

import json
import math

import pytest

from backplane.cli import main
from backplane.engine import Engine
from backplane.scheduler.request import RequestOutput

TINY = ["--model", "tiny-llama", "--device", "cpu", "--attention-backend", "torch_native"]
GEN = ["generate", *TINY, "--max-new-tokens", "2", "--input-ids", "5,6"]
BENCH = ["bench", *TINY, "--max-total-tokens", "256", "--input-len", "8", "--output-len", "2"]

RESOURCE_ROWS = [
    ("max_total_tokens_1", [*GEN, "--max-total-tokens", "1"],
     "--max-total-tokens 1: expected at least 2 (slot 0 of the KV pool is the padding slot"),
    ("max_total_tokens_huge", [*GEN, "--max-total-tokens", str(10**13)],
     f"--max-total-tokens {10**13}: {10**13} KV tokens need "),
    ("max_running_huge", [*GEN, "--max-running-requests", str(10**9)],
     f"--max-running-requests {10**9}: {10**9} request rows need "),
    ("context_above_model", [*GEN, "--context-length", "4096"],
     "--context-length 4096: expected at most the model's max_position_embeddings 2048"),
    ("bench_batch_0", [*BENCH, "--batch-size", "0"], "argument --batch-size: expected an integer >= 1, got '0'"),
    ("bench_input_0", [*BENCH, "--input-len", "0"], "argument --input-len: expected an integer >= 1, got '0'"),
    ("bench_too_long", [*BENCH, "--batch-size", "1", "--input-len", "3000"],
     "--input-len 3000 + --output-len 2: expected at most the context length 2048"),
    ("bench_pool", [*BENCH, "--batch-size", "40"], "--batch-size 40: 40 x (8 + 2) tokens need 400 KV slots, "
                                                   "the pool has 255; raise --max-total-tokens or lower it"),
    ("plugin_option", [*GEN, "--triton-attention.num-kv-splits", "100", "--triton-attention.max-kv-splits", "8"],
     "--triton-attention.num-kv-splits (env BACKPLANE_TRITON_ATTENTION__NUM_KV_SPLITS): invalid value '100': "
     "expected at most max_kv_splits=8, got 100"),
]


@pytest.mark.parametrize("case, argv, fragment", RESOURCE_ROWS, ids=[r[0] for r in RESOURCE_ROWS])
def test_resource_flag_errors_name_the_flag(case, argv, fragment, capsys):  # R62, R63
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("backplane: error: "), err
    assert fragment in err
    if case.endswith("_huge"):
        assert "memory but " in err and "expected at most about " in err


def test_json_output_has_no_nan(monkeypatch, capsys):  # R64
    def nan_outputs(self, *args, **kwargs):
        return [RequestOutput(token_ids=[5, 6], text="", finish_reason="length", logprobs=[math.nan, -1.5],
                              prompt_token_ids=[5, 6]),
                RequestOutput(token_ids=[7], text="", finish_reason="length", logprobs=[-math.inf],
                              prompt_token_ids=[5, 6])]

    monkeypatch.setattr(Engine, "generate", nan_outputs)
    assert main([*GEN, "--json"]) == 0
    out = capsys.readouterr().out

    def refuse(constant):
        raise AssertionError(f"bare {constant} in --json output")

    doc = json.loads(out, parse_constant=refuse)
    assert [o["logprobs"] for o in doc["outputs"]] == [[None, -1.5], [None]]


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys):  # R65
    stopped = []

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Engine, "generate", interrupted)
    original = Engine.shutdown
    monkeypatch.setattr(Engine, "shutdown", lambda self: stopped.append(self) or original(self))
    assert main(GEN) == 130
    captured = capsys.readouterr()
    assert captured.err == "backplane: interrupted\n" and captured.out == ""
    assert len(stopped) >= 1  # the command's engine was shut down on the way out
