"""Host time of one decode step with the model forward stubbed: the scheduler's own per-step cost.

A real `Scheduler` runs over real pools on the CPU; the model runner is a stub whose forward
returns a preallocated logits slice, so what is timed is everything the host does around the
forward: scheduling, building the decode batch, the req_to_token write, sampling (greedy, argmax
over a small vocabulary), the token copy and advancing the requests. Per running batch size
(--batch-sizes, default 1 32 256), with overlap scheduling on and off, the decode batch is built
both ways, rounds alternating their order (list then persistent, persistent then list, ...):

- list: `DecodeState(reuse=False)`, every step built from host lists (the path before issue 20);
- persistent: `DecodeState(reuse=True)`, a step of the same requests advances the last batch in place.

Each round starts a fresh scheduler, prefills --batch-size requests, runs --warmup decode steps,
then times --steps steps one by one (time.perf_counter, the garbage collector off). Reported per
configuration: the median step time over all rounds and the median time inside `DecodeState.build`,
in µs. JSON to --out (default $OUT/host_step.json when $OUT is set); a table last.

    python bench/host_step.py
    python bench/host_step.py --batch-sizes 1 4 --rounds 2 --steps 20 --warmup 3   # smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from backplane import SamplingParams
from backplane.engine.request import Req
from backplane.engine.scheduler import Scheduler
from backplane.executor.memory import ReqToTokenPool, TokenToKVPool

MODES = {"list": False, "persistent": True}  # name -> DecodeState.reuse
PROMPT_LEN = 8
VOCAB = 64


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 256])
    p.add_argument("--rounds", type=int, default=6, help="rounds per configuration, modes alternating")
    p.add_argument("--steps", type=int, default=200, help="timed decode steps per round")
    p.add_argument("--warmup", type=int, default=20, help="untimed decode steps per round")
    p.add_argument("--out", default=None, help="JSON path (default $OUT/host_step.json when $OUT is set)")
    return p.parse_args(argv)


class StubRunner:
    """What the Scheduler reads from a model runner; `forward` returns preallocated logits [bs, VOCAB]."""

    def __init__(self, max_bs: int, num_tokens_per_req: int):
        self.device = torch.device("cpu")
        self.context_len = num_tokens_per_req + 8
        self.req_to_token_pool = ReqToTokenPool(max_bs + 1, self.context_len, self.device)
        self.token_to_kv_pool = TokenToKVPool(max_bs * self.context_len, 1, 1, 1, torch.float32, self.device)
        self.logits = torch.randn(max_bs * PROMPT_LEN, VOCAB)

    def forward(self, batch):
        return SimpleNamespace(logits=self.logits[: batch.batch_size])


def timed_round(bs: int, reuse: bool, overlap: bool, ns: argparse.Namespace) -> tuple[list[float], list[float]]:
    """(step times, build times) in seconds for --steps decode steps of `bs` requests."""
    runner = StubRunner(bs, PROMPT_LEN + ns.warmup + ns.steps + 4)
    sched = Scheduler(runner, max_running=bs, chunk_size=bs * PROMPT_LEN, eos_token_ids=set(),
                      detokenize=lambda ids: "", overlap=overlap)
    sched.decode_state.reuse = reuse
    params = SamplingParams(max_new_tokens=ns.warmup + ns.steps + 2, temperature=0.0, ignore_eos=True)
    for rid in range(bs):
        sched.add(Req(rid, [(rid + i) % VOCAB for i in range(PROMPT_LEN)], params))
    sched.step()  # the prefill of every request
    for _ in range(ns.warmup):
        sched.step()
    builds, build = [], sched.decode_state.build

    def timed_build(reqs):
        start = time.perf_counter()
        batch = build(reqs)
        builds.append(time.perf_counter() - start)
        return batch

    sched.decode_state.build = timed_build
    steps = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(ns.steps):
            start = time.perf_counter()
            sched.step()
            steps.append(time.perf_counter() - start)
    finally:
        gc.enable()
    assert len(sched.running) == bs, f"expected {bs} requests still decoding, got {len(sched.running)}"
    return steps, builds


def bench(ns: argparse.Namespace) -> list[dict]:
    rows = []
    for overlap in (True, False):
        for bs in ns.batch_sizes:
            samples = {name: ([], []) for name in MODES}
            for r in range(ns.rounds):
                order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
                for name in order:
                    steps, builds = timed_round(bs, MODES[name], overlap, ns)
                    samples[name][0].extend(steps)
                    samples[name][1].extend(builds)
            row = {"overlap": overlap, "batch_size": bs}
            for name, (steps, builds) in samples.items():
                row[f"{name}_step_us"] = round(1e6 * statistics.median(steps), 1)
                row[f"{name}_build_us"] = round(1e6 * statistics.median(builds), 1)
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| overlap | bs | step µs list | step µs persistent | step ratio | build µs list | build µs persistent |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ratio = r["list_step_us"] / r["persistent_step_us"]
        lines.append(f"| {'on' if r['overlap'] else 'off'} | {r['batch_size']} | {r['list_step_us']} | "
                     f"{r['persistent_step_us']} | {ratio:.2f}× | {r['list_build_us']} | {r['persistent_build_us']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ns = parse_args(argv)
    torch.set_num_threads(1)
    rows = bench(ns)
    out = ns.out or (str(Path(os.environ["OUT"]) / "host_step.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(json.dumps({"settings": vars(ns), "torch": torch.__version__, "rows": rows}, indent=2))
    print(table(rows))


if __name__ == "__main__":
    main()
