"""bench/ttft.py and the peer's extend on CPU: every scenario is measured on both engines beside the
peer, the ratios come from the medians, the repeated and cached-prefix requests really compute only
their new tokens, and with extend graphs (triton interpreted, `rerun_capture`) the replays are the
buckets the ladder says; the peer's extend over its cache chooses what its whole prefill chooses."""

from __future__ import annotations

import json
import os
import statistics

import pytest
import torch

from helpers_bench import CPU
from bench import peer, steps, ttft

SMALL = ["--fresh", "16", "32", "--repeat", "32", "--prefix", "40", "8", "--decode-context", "24",
         "--decode-steps", "3", "--repeats", "2", "--no-compile"]


def test_every_scenario_beside_the_peer_with_ratios_of_the_medians(tmp_path, capsys):
    got = ttft.main(["--models", "tiny-llama", "--backends", "torch_native", *SMALL, "--out", str(tmp_path), *CPU])
    rows = got["rows"]
    assert [r["scenario"] for r in rows] == ["fresh-16", "fresh-32", "repeat-32", "prefix-40+8", "decode@24"]
    want_computed = {"fresh-16": [16, 16], "fresh-32": [32, 32], "repeat-32": [1, 1], "prefix-40+8": [8, 8],
                     "decode@24": [None, None]}
    for r in rows:
        for v in ("off", "on"):
            assert r[f"{v}_ms"] == statistics.median(r[f"{v}_runs_ms"]) and len(r[f"{v}_runs_ms"]) == 2
            assert r[f"{v}_computed"] == want_computed[r["scenario"]], r  # the radix cache served the rest
            assert r[f"{v}_peer"] == r[f"{v}_ms"] / r["peer_ms"]
        assert r["peer_ms"] > 0 and r["on_off"] == r["on_ms"] / r["off_ms"]
        assert r.get("replayed") == (None if r["kind"] == "decode" else "eager")  # no graphs on CPU
    (line,) = got["summary"]
    by = {r["scenario"]: r for r in rows}
    assert line["on/peer fresh-32"] == by["fresh-32"]["on_ms"] / by["fresh-32"]["peer_ms"]
    assert line["off cached/decode"] == by["repeat-32"]["off_ms"] / by["decode@24"]["off_ms"]
    assert [(c["variant"], c["graphs"]) for c in got["captures"]] == [("off", 0), ("on", 0)]
    assert all(c["startup_s"] > 0 for c in got["captures"])
    (path,) = tmp_path.glob("ttft-tiny-llama-cpu-*.json")
    doc = json.loads(path.read_text())
    assert doc["meta"]["card"] == "cpu" and len(doc["rows"]) == 5 and doc["peer"]["repeat-32"] == by["repeat-32"]["peer_ms"]
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-7].startswith("time to first token")  # the table comes last (title, header, 5 rows)


def engine_with_cpu_extend_graphs(**settings):
    """An Engine whose graph runner (extend and decode, full capture) re-runs the captured Python at
    every replay: the static-buffer path of extend graphs on CPU; none with disable_extend_graph."""
    from backplane import Engine
    from backplane.contracts.batch import ForwardMode
    from backplane.executor.graph_runner import GraphRunner, rerun_capture

    engine = Engine(**settings)
    if not settings.get("disable_extend_graph"):
        graphs = GraphRunner(engine.runner.graph_context(), {ForwardMode.EXTEND: "full", ForwardMode.DECODE: "full"})
        graphs.capture_fn = rerun_capture
        graphs.capture()
        engine.runner.graph_runner = graphs
    return engine


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available(),
                    reason="the CPU run of Triton needs TRITON_INTERPRET=1 (and no GPU)")
def test_extend_graphs_replay_the_buckets_the_ladder_names(tmp_path, monkeypatch):
    monkeypatch.setattr(steps, "Engine", engine_with_cpu_extend_graphs)
    got = ttft.main(["--models", "tiny-llama", "--backends", "triton", "--fresh", "16", "--repeat", "16",
                     "--prefix", "16", "8", "--decode-context", "0", "--repeats", "1", "--no-compile",
                     "--cuda-graph-max-tokens", "16", "--cuda-graph-max-extend-bs", "2", "--out", str(tmp_path), *CPU])
    # buckets 8 and 16 of 1 or 2 requests; a cached prompt's one new token runs as a decode batch
    # (the launcher's one-token prefills) and replays the decode graph of one request
    assert {r["scenario"]: (r["computed"], r["replayed"]) for r in got["rows"]} == {
        "fresh-16": ("16", "1x16"), "repeat-16": ("1", "decode@1"), "prefix-16+8": ("8", "1x8")}
    off, on = got["captures"]
    assert (off["variant"], off["graphs"], off["extend"]) == ("off", 0, None)
    assert (on["variant"], on["graphs"], on["extend"], on["extend_buckets"], on["extend_sizes"]) == ("on", 5, "full", [8, 16], [1, 2])
    assert on["capture_s"] > 0


def test_the_peers_extend_over_its_cache_chooses_what_its_whole_prefill_chooses():
    from backplane.models.presets import get_preset

    torch.manual_seed(0)
    model = peer.PeerLlama(get_preset("tiny-llama"), 1, 40, torch.float32, torch.device("cpu"))
    ids = torch.randint(3, 500, (1, 19))
    with torch.inference_mode():
        whole = model(ids, torch.tensor([0]))
        model(ids[:, :13], torch.tensor([0]))  # the cache holds positions 0..12
        extended = model(ids[:, 13:], torch.tensor([13]), over_cache=True)
        fresh_tail = model(ids[:, 13:], torch.tensor([13]))  # without the cache: a prefill of the tail alone
    assert torch.equal(whole, extended) and not torch.equal(whole, fresh_tail)


def test_the_peer_times_each_case_and_a_decode_step_per_one_token_case():
    from backplane.models.presets import get_preset

    times = peer.extend_ms(get_preset("tiny-llama"), [(0, 16), (15, 1), (20, 4)], torch.device("cpu"), False,
                           repeats=2, decode_steps=2)
    assert sorted(times) == [(0, 16), (15, 0), (15, 1), (20, 4)] and all(ms > 0 for ms in times.values())


def test_a_profiled_request_splits_its_host_time_into_ops_and_python_functions(tmp_path, capsys):
    got = ttft.main(["--models", "tiny-llama", "--backends", "torch_native", "--fresh", "16", "--repeat", "16",
                     "--prefix", "0", "0", "--decode-context", "0", "--repeats", "1", "--no-compile",
                     "--profile", "repeat-16", "--out", str(tmp_path), *CPU])
    fresh, repeat = got["rows"]
    assert "profile" not in fresh
    split = repeat["profile"]
    assert 0 < split["wall_ms"] and (split["kernels"], split["device_busy_ms"], split["h2d"], split["d2h"]) == (0, 0, 0, 0)
    ops, python = dict((n, ms) for n, ms, _ in split["top_ops"]), [n for n, _, _ in split["top_python"]]
    assert len(ops) == 8 and all(ms > 0 for ms in ops.values()) and any(n.startswith("aten::") for n in ops)
    # (a function generated at run time, such as a dataclass's __init__, is named after "<string>"; the
    # profiler names a module's forward "nn.Module: <class>_<n>")
    assert len(python) == 8 and all(".py(" in n or n.startswith(("<built-in", "<string>", "nn.Module: ")) for n in python)
    assert sum(ops.values()) < split["wall_ms"]  # self times within the request
    (path,) = tmp_path.glob("ttft-tiny-llama-cpu-*.json")
    assert json.loads(path.read_text())["rows"][1]["profile"]["top_ops"][0][0] == split["top_ops"][0][0]
    out = capsys.readouterr().out.splitlines()
    title = out.index(next(line for line in out if line.startswith("one request under the profiler")))
    assert out[title + 2].split()[:3] == ["tiny-llama", "torch_native", "repeat-16"]
    assert any(line.strip().startswith("tiny-llama torch_native repeat-16 top_python:") for line in out)


def test_profile_names_a_scenario_of_the_run(capsys):
    with pytest.raises(SystemExit):
        ttft.parse_args(["--fresh", "16", "--profile", "fresh-32", *CPU])
    assert "--profile: expected scenario names among" in capsys.readouterr().err
