"""The CLI's first use (issue 42): help on every flag of bench and serve, a --tp-size the heads do
not divide refused in one line before any worker starts, bench saying which CPU threads it used and
why it has no graph rows on CPU."""

from __future__ import annotations

import json

import pytest

from backplane.cli import main
from backplane.cli.main import build_parser
from backplane.plugin.manager import load_plugins


def subcommand_actions(name: str):
    parser = build_parser(load_plugins())
    sub = next(a for a in parser._actions if a.dest == "command")
    return [a for a in sub.choices[name]._actions if a.option_strings and a.dest != "help"]


@pytest.mark.parametrize("command", ["generate", "bench", "serve"])
def test_every_flag_has_help(command):
    missing = [a.option_strings[0] for a in subcommand_actions(command) if not (a.help or "").strip()]
    assert not missing, f"backplane {command}: flags without help: {missing}"


def test_tp_size_the_heads_do_not_divide_fails_before_any_worker(capsys, monkeypatch):
    import backplane.distributed.driver as driver

    def no_workers(*args, **kwargs):
        raise AssertionError("a tensor-parallel worker was started")

    monkeypatch.setattr(driver.TPDriver, "__init__", no_workers)
    code = main(["bench", "--model", "tiny-llama", "--device", "cpu", "--tp-size", "8", "--batch-size", "1",
                 "--input-len", "4", "--output-len", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith("backplane: error: --tp-size 8: the model's num_attention_heads")


def test_bench_says_threads_and_why_no_graph_rows(capsys, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    code = main(["bench", "--model", "tiny-llama", "--device", "cpu", "--batch-size", "1", "--input-len", "8",
                 "--output-len", "2", "--cpu-threads", "1", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    assert report["threads"] == "CPU threads: 1 (--cpu-threads)"
    assert report["graph_note"] == "no graph rows: CUDA graphs need a CUDA device, this run is on cpu"
