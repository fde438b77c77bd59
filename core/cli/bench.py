"""`backplane bench`: one-batch latency in the style of SGLang's bench_one_batch.

For each batch size: prefill `--input-len` random tokens per request in one batch, then decode
`--output-len` steps, eagerly and (on CUDA) through the captured graphs, on identical batches.
Reports prefill latency/throughput, median decode step latency/throughput, capture time, graph
memory and which plugins served the run; `--json` prints one document, `--plot` draws decode
latency against batch size.

The model is built as the Engine builds it, so `--lora-paths` (requests take the adapters in turn)
and `--speculative-algorithm` apply. With speculation, each batch size also runs greedy generation
through the speculative worker and reports its tokens/s and mean acceptance length (tokens gained
per request per verify step, 1 to --speculative-num-draft-tokens).
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time
from typing import Any

import torch

from backplane.scheduler.batch_builder import build_decode_batch, build_extend_batch
from backplane.scheduler.request import Req
from backplane.scheduler.sampling_params import SamplingParams


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("benchmark")
    g.add_argument("--batch-size", type=positive_int, nargs="+", default=[1, 8, 32],
                   help="batch sizes to measure, one batch each (default: 1 8 32)")
    g.add_argument("--input-len", type=positive_int, default=512,
                   help="random prompt tokens per request, prefilled in one batch (default: 512)")
    g.add_argument("--output-len", type=positive_int, default=16,
                   help="decode steps timed per batch; the median step is reported (default: 16)")
    g.add_argument("--json", action="store_true", help="print one JSON document")
    g.add_argument("--plot", default=None, metavar="FILE.png", help="decode latency against batch size")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (argparse names the flag in its one-line error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def check_bench_fits(ns: argparse.Namespace, runner) -> None:
    """Refuse sizes the pools cannot hold, naming the flag, before anything is measured."""
    need = ns.input_len + ns.output_len
    if need > runner.context_len:
        raise ValueError(f"--input-len {ns.input_len} + --output-len {ns.output_len}: expected at most the "
                         f"context length {runner.context_len}")
    rows = runner.req_to_token_pool.size - 1
    slots = runner.token_to_kv_pool.num_slots - 1
    for bs in ns.batch_size:
        if bs > rows:
            raise ValueError(f"--batch-size {bs}: expected at most {rows} (the request rows; raise "
                             "--max-running-requests)")
        if bs * need > slots:
            raise ValueError(f"--batch-size {bs}: {bs} x ({ns.input_len} + {ns.output_len}) tokens need "
                             f"{bs * need} KV slots, the pool has {slots}; raise --max-total-tokens or lower it")


def forward_eagerly(runner, batch):
    """One eager forward that every tensor-parallel rank runs too.

    `forward_eager` is this rank's model alone: under tensor parallelism rank 0 would wait in
    all_reduce for workers that wait for a batch. The runner's `forward(batch, use_graph=False)`
    goes through the router; a runner without that argument is driven through `router.run`.
    """
    if "use_graph" in inspect.signature(runner.forward).parameters:
        return runner.forward(batch, use_graph=False)
    if runner.router is not None:
        return runner.router.run(batch, runner.forward_eager)
    return runner.forward_eager(batch)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class OneBatch:
    """A batch of `bs` requests held in the runner's pools for the length of one measurement."""

    def __init__(self, runner, bs: int, input_len: int, seed: int, lora=None):
        gen = torch.Generator().manual_seed(seed)
        vocab = int(runner.hf_config.vocab_size)
        self.runner, self.lora = runner, lora
        names = sorted(lora.adapters)[: lora.max_loras_per_batch] if lora is not None else [None]
        self.reqs = [Req(i, torch.randint(3, vocab, (input_len,), generator=gen).tolist(), SamplingParams(),
                         names[i % len(names)]) for i in range(bs)]
        for req in self.reqs:
            req.row = runner.req_to_token_pool.alloc()

    def prefill(self) -> torch.Tensor:
        batch = self._prepared(build_extend_batch(self.reqs, [len(r.prompt_ids) for r in self.reqs],
                                                  self.runner.token_to_kv_pool, self.runner.req_to_token_pool))
        logits = self.runner.forward(batch).logits
        for req in self.reqs:
            req.num_cached = len(req.prompt_ids)
        return logits.argmax(-1)

    def decode(self, tokens: torch.Tensor, eager: bool) -> torch.Tensor:
        for req, token in zip(self.reqs, tokens.tolist()):
            req.output_ids.append(token)
        batch = self._prepared(build_decode_batch(self.reqs, self.runner.token_to_kv_pool,
                                                  self.runner.req_to_token_pool))
        for req in self.reqs:
            req.num_cached += 1
        out = forward_eagerly(self.runner, batch) if eager else self.runner.forward(batch)
        return out.logits.argmax(-1)

    def _prepared(self, batch):
        if self.lora is not None:
            self.lora.prepare_batch(batch, self.reqs)
        return batch

    def release(self) -> None:
        for req in self.reqs:
            self.runner.token_to_kv_pool.free(torch.cat(req.slots))
            self.runner.req_to_token_pool.free(req.row)


@torch.inference_mode()
def measure(runner, bs: int, input_len: int, output_len: int, eager: bool, seed: int = 0,
            lora=None) -> dict[str, Any]:
    device = runner.device
    one = OneBatch(runner, bs, input_len, seed, lora)
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


def measure_speculative(engine, bs: int, input_len: int, output_len: int, seed: int = 0) -> dict[str, Any]:
    """Greedy generation of `bs` random prompts through the speculative worker: tokens/s, acceptance."""
    gen = torch.Generator().manual_seed(seed)
    vocab = int(engine.runner.hf_config.vocab_size)
    prompts = [torch.randint(3, vocab, (input_len,), generator=gen).tolist() for _ in range(bs)]
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    stats = engine.spec_worker.stats
    tokens_before, steps_before = stats.tokens, stats.request_steps
    _sync(engine.runner.device)
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    _sync(engine.runner.device)
    elapsed = time.perf_counter() - start
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(f"speculative generation at batch size {bs} failed: {errors[0]}")
    steps = stats.request_steps - steps_before
    return {"batch_size": bs, "tok_s": sum(len(o.token_ids) for o in outs) / elapsed,
            "acceptance_length": (stats.tokens - tokens_before) / max(steps, 1), "verify_steps": steps}


def run_bench(ns: argparse.Namespace, args, plugin_set) -> int:
    from backplane.cli.args import preflight
    from backplane.distributed import WorkerFailedError
    from backplane.engine import Engine

    threads = preflight(args)
    try:
        engine = Engine(server_args=args, plugin_set=plugin_set)
        try:
            return _bench(ns, engine, threads)
        finally:  # also on Ctrl-C: tensor-parallel workers stop with the command
            engine.shutdown()
    except WorkerFailedError as err:  # the worker's cause, on one line (main prints it, exit 2)
        raise ValueError(first_line(err)) from None


def first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def graph_note(runner) -> str | None:
    """Why the report has no graph rows, or None when it has them."""
    if runner.graph_runner is not None:
        return None
    if runner.device.type != "cuda":
        return f"no graph rows: CUDA graphs need a CUDA device, this run is on {runner.device.type}"
    return "no graph rows: CUDA graphs are off (--disable-cuda-graph, or no mode of this combination can be captured)"


def _bench(ns: argparse.Namespace, engine, threads: str) -> int:
    args, runner, lora = engine.args, engine.runner, engine.lora_manager
    check_bench_fits(ns, runner)
    modes = [True] + ([False] if runner.graph_runner is not None else [])
    for bs in ns.batch_size:  # warm-up pass: kernels compile and autotune outside the timings
        measure(runner, bs, min(ns.input_len, 64), 2, eager=True, lora=lora)
    rows = [measure(runner, bs, ns.input_len, ns.output_len, eager, lora=lora)
            for bs in ns.batch_size for eager in modes]
    gr = runner.graph_runner
    backends = engine.backends
    report = {"model": args.model, "input_len": ns.input_len, "output_len": ns.output_len,
              "backends": backends, "results": rows,
              "graph": None if gr is None else {"batch_sizes": gr.sizes, "capture_s": gr.capture_seconds,
                                                "memory_mb": gr.graph_memory_bytes / 2**20},
              "graph_mode_limits": [m.message() for m in runner.graph_mode_limits],
              "graph_note": graph_note(runner), "threads": threads}
    if engine.spec_worker is not None:
        measure_speculative(engine, 1, min(ns.input_len, 64), 4)  # warm-up
        report["speculative"] = {
            "algorithm": backends["speculative"]["algorithm"],
            "num_draft_tokens": engine.spec_worker.num_draft_tokens,
            "results": [measure_speculative(engine, bs, ns.input_len, ns.output_len) for bs in ns.batch_size],
        }
    print(json.dumps(report, indent=2) if ns.json else format_report(report))
    if ns.plot:
        plot_decode(report, ns.plot)
    return 0


def format_report(report: dict[str, Any]) -> str:
    attn = report["backends"]["attention"]
    lines = [f"model {report['model']} on {report['backends']['device']} ({report['backends']['dtype']}), "
             f"attention prefill={attn['prefill']['backend']} decode={attn['decode']['backend']}, "
             f"input {report['input_len']}, output {report['output_len']}"]
    lines.append(report["threads"])
    if report["graph"]:
        g = report["graph"]
        lines.append(f"graphs: {len(g['batch_sizes'])} sizes captured in {g['capture_s']:.1f} s, {g['memory_mb']:.0f} MB")
    if report["graph_note"]:
        lines.append(report["graph_note"])
    lines += report["graph_mode_limits"]
    lines.append(f"overlap scheduling: {'on' if report['backends'].get('overlap_schedule') else 'off'} "
                 "(applies to generate; the rows below time single forwards)")
    lines.append(f"{'bs':>4} {'mode':>6} {'prefill ms':>11} {'prefill tok/s':>14} {'decode ms':>10} {'decode tok/s':>13}")
    for r in report["results"]:
        lines.append(f"{r['batch_size']:>4} {r['mode']:>6} {r['prefill_ms']:>11.2f} {r['prefill_tok_s']:>14.0f} "
                     f"{r['decode_step_ms']:>10.3f} {r['decode_tok_s']:>13.0f}")
    if "lora" in report["backends"]:
        lora = report["backends"]["lora"]
        lines.append(f"LoRA backend {lora['backend']}: requests take the adapters {', '.join(sorted(lora['adapters']))} in turn")
    spec = report.get("speculative")
    if spec:
        lines.append(f"speculative {spec['algorithm']} ({spec['num_draft_tokens']} draft tokens), greedy generation "
                     "(overlap scheduling off: speculative steps are not overlapped yet):")
        lines.append(f"{'bs':>4} {'tok/s':>9} {'acceptance length':>18}")
        for r in spec["results"]:
            lines.append(f"{r['batch_size']:>4} {r['tok_s']:>9.0f} {r['acceptance_length']:>18.2f}")
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
