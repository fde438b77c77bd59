"""bench/prefix_cache.py on CPU, tiny sizes: the counts it reports (prefill tokens against the
ideal, decode steps, the TTFT probes' cache hits) and the table."""

from __future__ import annotations

from helpers_bench import load_bench


def _load():
    return load_bench("prefix_cache")


def test_smoke_run_reports_reuse_and_probe_hits():
    bench = _load()
    ns = bench.parse_args(["--device", "cpu", "--dtype", "float32", "--backend", "torch_native", "--num-groups", "2",
                           "--per-group", "3", "--prefix-len", "40", "--suffix-len", "6", "--output-len", "3",
                           "--probes", "1", "--repeats", "2"])
    result = bench.bench_model("tiny-llama", ns)
    shared, ideal = result["shared"], result["ideal_prefill_tokens"]
    assert ideal == {"shared": {"on": 2 * 40 + 6 * 6, "off": 6 * 46}, "nothing_shared": {"on": 6 * 46, "off": 6 * 46}}
    for run in shared["runs_on"]:
        assert run["prefill_tokens"] == run["prefix_cache"]["prefill_tokens"] == ideal["shared"]["on"]
        assert run["decode_steps"] >= 3 - 1 and run["decode_steps_eager"] == run["decode_steps"]  # no graphs on CPU
    assert [r["prefill_tokens"] for r in shared["runs_off"]] == [ideal["shared"]["off"]] * 2
    assert shared["greedy_equal"] == 6 and result["nothing_shared"]["greedy_equal"] == 6
    hits = {name: [p["hit_tokens"] for p in probes] for name, probes in result["ttft"]["probes"].items()}
    assert hits == {"uncached": [0], "cached": [40], "floor": [45]}
    assert result["ttft"]["ratio"] == result["ttft"]["cached_ttft_s"] / result["ttft"]["uncached_ttft_s"]
    lines = bench.table([result]).splitlines()
    assert len(lines) == 4 and f"{2 * 40 + 6 * 6}/{2 * 40 + 6 * 6}/{6 * 46}" in lines[1]
