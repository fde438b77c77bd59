"""Tensor parallelism on GPU: greedy tokens of tp N against tp 1, and decode step latency.

  python bench/tp.py run --tp-size N --out tpN.json   # one tensor-parallel size, one JSON document
  python bench/tp.py compare tp1.json tp2.json         # greedy equality and the latency table

`run` serves two models with --load-format dummy (the full tensors are drawn from --seed, then
sharded, so every tp size serves the same model): the check model in float32 (greedy tokens and
their logprobs for fixed prompts; float32 so that reduction order cannot flip a greedy choice),
then the benchmark model (default llama-3.1-8b, bfloat16) for one-batch prefill and decode step
latency per batch size (through the captured graphs unless --disable-cuda-graph), plus its greedy
tokens, which in bfloat16 may legitimately differ after a near tie.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

PROMPT_LENS = (5, 33, 120, 17)


def prompts(vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, min(vocab, 32000), (n,), generator=gen).tolist() for n in PROMPT_LENS]


def greedy(engine, new_tokens: int, seed: int) -> list[dict]:
    from backplane import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    outs = engine.generate(input_ids=prompts(int(engine.runner.hf_config.vocab_size), seed), sampling_params=params)
    return [{"token_ids": o.token_ids, "logprobs": o.logprobs} for o in outs]


def engine_for(ns: argparse.Namespace, model: str, dtype: str):
    from backplane import Engine

    return Engine(model, tp_size=ns.tp_size, dtype=dtype, load_format="dummy", seed=ns.seed,
                  max_total_tokens=ns.max_total_tokens, cuda_graph_max_bs=max(ns.batch_size),
                  disable_cuda_graph=ns.disable_cuda_graph)


def latency(engine, ns: argparse.Namespace) -> list[dict]:
    from backplane.cli.bench import measure

    runner = engine.runner
    mode = "graph" if runner.graph_runner is not None else "eager"
    for bs in ns.batch_size:  # warm-up: kernels compile and autotune outside the timings
        measure(runner, bs, min(ns.input_len, 64), 2, eager=False)
    # NOTE: eager=False goes through runner.forward (the tensor-parallel driver); replays graphs if captured.
    rows = [measure(runner, bs, ns.input_len, ns.output_len, eager=False) for bs in ns.batch_size]
    return [{**row, "mode": mode} for row in rows]


def run(ns: argparse.Namespace) -> int:
    report = {"tp_size": ns.tp_size, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "check_model": ns.check_model, "model": ns.model, "dtype": ns.dtype}
    engine = engine_for(ns, ns.check_model, "float32")
    try:
        report["check_greedy"] = greedy(engine, ns.new_tokens, ns.seed)
    finally:
        engine.shutdown()
    del engine
    torch.cuda.empty_cache()
    engine = engine_for(ns, ns.model, ns.dtype)
    try:
        report["backends"] = engine.backends
        report["greedy"] = greedy(engine, ns.new_tokens, ns.seed)
        report["results"] = latency(engine, ns)
    finally:
        engine.shutdown()
    with open(ns.out, "w") as f:
        json.dump(report, f, indent=1)
    print(format_latency([report]))
    return 0


def matching_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare_greedy(base: list[dict], other: list[dict]) -> dict:
    prefixes = [matching_prefix(x["token_ids"], y["token_ids"]) for x, y in zip(base, other)]
    equal = all(x["token_ids"] == y["token_ids"] for x, y in zip(base, other))
    diffs = [abs(p - q) for x, y in zip(base, other) for p, q in zip(x["logprobs"], y["logprobs"])]
    return {"equal": equal, "matching_prefix": prefixes, "max_logprob_diff": max(diffs, default=0.0)}


def format_latency(reports: list[dict]) -> str:
    lines = [f"{'tp':>3} {'bs':>4} {'mode':>6} {'prefill ms':>11} {'decode ms':>10} {'decode tok/s':>13}   model"]
    for rep in reports:
        for r in rep["results"]:
            lines.append(f"{rep['tp_size']:>3} {r['batch_size']:>4} {r['mode']:>6} {r['prefill_ms']:>11.2f} "
                         f"{r['decode_step_ms']:>10.3f} {r['decode_tok_s']:>13.0f}   {rep['model']} {rep['dtype']} "
                         f"on {rep['device']}")
    return "\n".join(lines)


def compare(ns: argparse.Namespace) -> int:
    reports = []
    for path in ns.files:
        with open(path) as f:
            reports.append(json.load(f))
    base = reports[0]
    ok = True
    for rep in reports[1:]:
        check = compare_greedy(base["check_greedy"], rep["check_greedy"])
        bench = compare_greedy(base["greedy"], rep["greedy"])
        ok &= check["equal"]
        print(f"tp {rep['tp_size']} vs tp {base['tp_size']}: {base['check_model']} float32 greedy "
              f"{'EQUAL' if check['equal'] else 'DIFFERENT'} (matching prefix {check['matching_prefix']}, "
              f"max logprob diff {check['max_logprob_diff']:.2e}); {base['model']} {base['dtype']} greedy "
              f"{'equal' if bench['equal'] else 'differs'} (matching prefix {bench['matching_prefix']}, "
              f"max logprob diff {bench['max_logprob_diff']:.2e})")
    print(format_latency(reports))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="serve one tensor-parallel size; write a JSON document")
    r.add_argument("--tp-size", type=int, default=1)
    r.add_argument("--model", default="llama-3.1-8b")
    r.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    r.add_argument("--check-model", default="llama-3.2-1b", help="served in float32 for the greedy check")
    r.add_argument("--batch-size", type=int, nargs="+", default=[1, 8, 32])
    r.add_argument("--input-len", type=int, default=512)
    r.add_argument("--output-len", type=int, default=32)
    r.add_argument("--new-tokens", type=int, default=24, help="greedy tokens per prompt")
    r.add_argument("--max-total-tokens", type=int, default=40000)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--disable-cuda-graph", action="store_true")
    r.add_argument("--out", required=True)
    c = sub.add_parser("compare", help="greedy equality against the first file, and the latency table")
    c.add_argument("files", nargs="+")
    ns = p.parse_args(argv)
    return run(ns) if ns.command == "run" else compare(ns)


if __name__ == "__main__":
    sys.exit(main())
