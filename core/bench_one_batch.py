"""`backplane bench`: one-batch latency in the style of SGLang's bench_one_batch.

For each batch size: prefill `--input-len` random tokens per request in one batch, then decode
`--output-len` steps, eagerly and (on CUDA) through the captured graphs, on identical batches.
Reports prefill latency/throughput, median decode step latency/throughput, capture time, graph
memory and which plugins served the run; `--json` prints one document, `--plot` draws decode
latency against batch size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from backplane.engine.batch_builder import build_decode_batch, build_extend_batch
from backplane.engine.request import Req
from backplane.engine.sampling_params import SamplingParams


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("benchmark")
    g.add_argument("--batch-size", type=int, nargs="+", default=[1, 8, 32])
    g.add_argument("--input-len", type=int, default=512)
    g.add_argument("--output-len", type=int, default=16)
    g.add_argument("--json", action="store_true", help="print one JSON document")
    g.add_argument("--plot", default=None, metavar="FILE.png", help="decode latency against batch size")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class OneBatch:
    """A batch of `bs` requests held in the runner's pools for the length of one measurement."""

    def __init__(self, runner, bs: int, input_len: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        vocab = int(runner.hf_config.vocab_size)
        self.runner = runner
        self.reqs = [Req(i, torch.randint(3, vocab, (input_len,), generator=gen).tolist(), SamplingParams())
                     for i in range(bs)]
        for req in self.reqs:
            req.row = runner.req_to_token_pool.alloc()

    def prefill(self) -> torch.Tensor:
        batch = build_extend_batch(self.reqs, [len(r.prompt_ids) for r in self.reqs],
                                   self.runner.token_to_kv_pool, self.runner.req_to_token_pool)
        logits = self.runner.forward(batch).logits
        for req in self.reqs:
            req.num_cached = len(req.prompt_ids)
        return logits.argmax(-1)

    def decode(self, tokens: torch.Tensor, eager: bool) -> torch.Tensor:
        for req, token in zip(self.reqs, tokens.tolist()):
            req.output_ids.append(token)
        batch = build_decode_batch(self.reqs, self.runner.token_to_kv_pool, self.runner.req_to_token_pool)
        for req in self.reqs:
            req.num_cached += 1
        out = self.runner.forward_eager(batch) if eager else self.runner.forward(batch)
        return out.logits.argmax(-1)

    def release(self) -> None:
        for req in self.reqs:
            self.runner.token_to_kv_pool.free(torch.cat(req.slots))
            self.runner.req_to_token_pool.free(req.row)


@torch.inference_mode()
def measure(runner, bs: int, input_len: int, output_len: int, eager: bool, seed: int = 0) -> dict[str, Any]:
    device = runner.device
    one = OneBatch(runner, bs, input_len, seed)
    try:
        _sync(device)
        start = time.perf_counter()
        tokens = one.prefill()
        _sync(device)
        prefill_s = time.perf_counter() - start
        steps = []
        for _ in range(output_len):
            start = time.perf_counter()
            tokens = one.decode(tokens, eager)
            _sync(device)
            steps.append(time.perf_counter() - start)
    finally:
        one.release()
    median = statistics.median(steps[1:] if len(steps) > 2 else steps)
    return {"batch_size": bs, "mode": "eager" if eager else "graph", "prefill_ms": prefill_s * 1e3,
            "prefill_tok_s": bs * input_len / prefill_s, "decode_step_ms": median * 1e3,
            "decode_tok_s": bs / median}


def run_bench(ns: argparse.Namespace, args, plugin_set) -> int:
    from backplane.model_runner import ModelRunner

    runner = ModelRunner(args, plugin_set)
    runner.init_cuda_graphs()
    modes = [True] + ([False] if runner.graph_runner is not None else [])
    for bs in ns.batch_size:  # warm-up pass: kernels compile and autotune outside the timings
        measure(runner, bs, min(ns.input_len, 64), 2, eager=True)
    rows = [measure(runner, bs, ns.input_len, ns.output_len, eager) for bs in ns.batch_size for eager in modes]
    gr = runner.graph_runner
    report = {"model": args.model, "input_len": ns.input_len, "output_len": ns.output_len,
              "backends": runner.backends_summary(), "results": rows,
              "graph": None if gr is None else {"batch_sizes": gr.sizes, "capture_s": gr.capture_seconds,
                                                "memory_mb": gr.graph_memory_bytes / 2**20},
              "graph_mode_limits": [m.message() for m in runner.graph_mode_limits]}
    print(json.dumps(report, indent=2) if ns.json else format_report(report))
    if ns.plot:
        plot_decode(report, ns.plot)
    return 0


def format_report(report: dict[str, Any]) -> str:
    attn = report["backends"]["attention"]
    lines = [f"model {report['model']} on {report['backends']['device']} ({report['backends']['dtype']}), "
             f"attention prefill={attn['prefill']['backend']} decode={attn['decode']['backend']}, "
             f"input {report['input_len']}, output {report['output_len']}"]
    if report["graph"]:
        g = report["graph"]
        lines.append(f"graphs: {len(g['batch_sizes'])} sizes captured in {g['capture_s']:.1f} s, {g['memory_mb']:.0f} MB")
    lines += report["graph_mode_limits"]
    lines.append(f"{'bs':>4} {'mode':>6} {'prefill ms':>11} {'prefill tok/s':>14} {'decode ms':>10} {'decode tok/s':>13}")
    for r in report["results"]:
        lines.append(f"{r['batch_size']:>4} {r['mode']:>6} {r['prefill_ms']:>11.2f} {r['prefill_tok_s']:>14.0f} "
                     f"{r['decode_step_ms']:>10.3f} {r['decode_tok_s']:>13.0f}")
    return "\n".join(lines)


def plot_decode(report: dict[str, Any], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot: needs matplotlib (pip install 'backplane-llm[plot]')") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in ("eager", "graph"):
        rows = [r for r in report["results"] if r["mode"] == mode]
        if rows:
            ax.plot([r["batch_size"] for r in rows], [r["decode_step_ms"] for r in rows], marker="o", label=mode)
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode step (ms)")
    ax.set_title(f"{report['model']}: {report['backends']['attention']['decode']['backend']}")
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
