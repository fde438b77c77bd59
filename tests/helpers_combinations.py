"""The plugin-combination matrix, shared by the CPU test (tests/test_combinations.py) and the GPU
test (tests/gpu/test_combinations_gpu.py).

A `Cell` is one combination: prefill and decode attention backends, LoRA backend (or none),
speculative algorithm (or none), torch.compile, CUDA graphs, and with graphs whether EXTEND is
captured too (extend graphs, off with --disable-extend-graph). `run_cell` builds an Engine for it
and generates greedily for one mixed batch (two adapters and base requests of different lengths
and output lengths; six requests, so a batch pads up to a captured size of 8), then compares every
request with the fp32 Hugging Face reference (the PEFT-merged model for an adapter's requests).
A divergence is a tie only when, at the first differing token, the reference's logit of its own
choice exceeds that of the engine's choice by at most `tie_fraction` of the logits' standard
deviation (so the reference's top two are that close); otherwise every token must be equal. A
cell whose Engine refuses the combination at startup (ValueError) is recorded as refused with
that message, which must be one line naming the flags.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest
import torch

from backplane import Engine, SamplingParams
from backplane.ops import opaque
from helpers_models import hf_greedy, save_exact_eagle_head
from lora_helpers import ADAPTERS, LoraWorld, make_lora_world

NAMES = ["all7_r4", "qv_down_r8"]
# One layer (the EAGLE head can reproduce it), head dim 64 (every attention backend serves it).
MODEL_SHAPE = dict(num_hidden_layers=1, hidden_size=128, intermediate_size=192, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=64)
# Motifs repeat so that ngram proposes, and verify accepts, several tokens per step.
PROMPTS = [[5, 17, 33] * 3, list(range(40, 51)), [7, 8] * 4, [101, 3, 250, 77], [12, 13, 14] * 2, [9]]
MIXED = ["all7_r4", None, "qv_down_r8", "all7_r4", None, "qv_down_r8"]
MAX_NEW = [8, 6, 7, 8, 5, 6]
SPECS = {
    "ngram": dict(speculative_algorithm="ngram", speculative_num_draft_tokens=4),
    # a top-2 tree: verify runs a tree mask, not only a chain
    "eagle": dict(speculative_algorithm="eagle", speculative_num_steps=2, speculative_eagle_topk=2,
                  speculative_num_draft_tokens=4),
}
SUMMARY_ENV = "BACKPLANE_MATRIX_OUT"


@dataclass(frozen=True)
class Cell:
    """One plugin combination. lora / spec None: without adapters / speculation."""

    prefill: str
    decode: str
    lora: str | None = None
    spec: str | None = None
    compile: bool = False
    graphs: bool = False
    extend_graphs: bool = True  # False: --disable-extend-graph (only decode-like modes captured)

    @property
    def label(self) -> str:
        attn = self.prefill if self.prefill == self.decode else f"{self.prefill}+{self.decode}"
        return (f"attn={attn} lora={self.lora or 'none'} spec={self.spec or 'none'} "
                f"compile={'on' if self.compile else 'off'} graphs={'on' if self.graphs else 'off'}"
                + ("" if self.extend_graphs else " extend-graphs=off"))

    @property
    def test_id(self) -> str:
        """The label in characters pytest's -k accepts: `-k "lora:triton and spec:eagle"`."""
        return self.label.replace("=", ":").replace(" ", "-")

    def engine_kwargs(self, world: MatrixWorld) -> dict:
        kw: dict = dict(prefill_attention_backend=self.prefill, decode_attention_backend=self.decode,
                        attention_backend=self.prefill, enable_torch_compile=self.compile,
                        disable_cuda_graph=not self.graphs, disable_extend_graph=not self.extend_graphs)
        if self.lora:
            kw.update(lora_paths=world.lora.lora_paths(), lora_backend=self.lora, max_loras_per_batch=2)
        if self.spec:
            kw.update(SPECS[self.spec])
            if self.spec == "eagle":
                kw["speculative_draft_model"] = world.eagle_head
        return kw


def pairwise(axes: dict[str, list]) -> list[dict]:
    """A small set of assignments covering every pair of values of every two axes (greedy,
    deterministic): each step takes the assignment of the full product that covers the most pairs
    not yet covered."""
    names = list(axes)
    product = [dict(zip(names, values)) for values in itertools.product(*axes.values())]

    def pairs(choice: dict) -> set:
        return {(a, choice[a], b, choice[b]) for a, b in itertools.combinations(names, 2)}

    uncovered = set().union(*(pairs(c) for c in product))
    chosen = []
    while uncovered:
        best = max(product, key=lambda c: len(pairs(c) & uncovered))
        chosen.append(best)
        uncovered -= pairs(best)
    return chosen


@dataclass
class Reference:
    """The fp32 reference of one request: greedy tokens and the logits each was chosen from."""

    tokens: list[int]
    logits: torch.Tensor  # [max_new, vocab]; row j: the distribution of token j


@dataclass
class MatrixWorld:
    """The saved base model, its two adapters, the EAGLE head, and the references (computed once
    per (request, adapter))."""

    lora: LoraWorld
    eagle_head: str
    references: dict[tuple[int, str | None], Reference] = field(default_factory=dict)

    def reference(self, index: int, adapter: str | None) -> Reference:
        key = (index, adapter)
        if key not in self.references:
            prompt = PROMPTS[index]
            ids, logits = hf_greedy(self.lora.merged[adapter], prompt, MAX_NEW[index])
            self.references[key] = Reference(ids[len(prompt):], logits[len(prompt) - 1: -1])
        return self.references[key]


def make_world(root: Path) -> MatrixWorld:
    lora = make_lora_world(root, {n: ADAPTERS[n] for n in NAMES}, **MODEL_SHAPE)
    return MatrixWorld(lora, save_exact_eagle_head(lora.merged[None], root / "eagle"))


@dataclass
class CellResult:
    """status: "ok" (every token equal), "tie" (diverged at near-ties only), "refused" (at
    startup; message: the refusal) or "mismatch" (message: what differs)."""

    label: str
    status: str
    message: str = ""
    ties: list = field(default_factory=list)  # (request, position, margin / std)
    seconds: float = 0.0


@contextlib.contextmanager
def _count_opaque_calls(counter: list):
    """Count the opaque attention op's real calls (compiled forwards, captures included)."""
    real = opaque.bound_batch
    opaque.bound_batch = lambda layer: counter.append(1) or real(layer)
    try:
        yield
    finally:
        opaque.bound_batch = real


def run_cell(world: MatrixWorld, cell: Cell, tie_fraction: float, **settings) -> CellResult:
    """Build the cell's Engine (with `settings`: device, dtype, pool sizes), generate, compare."""
    start, calls = time.perf_counter(), []
    adapters = MIXED if cell.lora else [None] * len(PROMPTS)
    try:
        with _count_opaque_calls(calls):
            try:
                engine = Engine(str(world.lora.base_dir), **settings, **cell.engine_kwargs(world))
            except ValueError as exc:
                return CellResult(cell.label, "refused", str(exc), seconds=time.perf_counter() - start)
            params = [SamplingParams(max_new_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_NEW]
            extend_replays = _count_extend_replays(engine)
            outs = engine.generate(input_ids=PROMPTS, sampling_params=params, lora=adapters if cell.lora else None)
        problems = _setup_problems(engine, cell, calls) + _extend_graph_problems(engine, cell, extend_replays)
        ties = []
        for i, (out, adapter) in enumerate(zip(outs, adapters)):
            problem, tie = compare(i, out, world.reference(i, adapter), tie_fraction)
            problems += [problem] if problem else []
            ties += [tie] if tie else []
    finally:
        engine = None
        gc.collect()
        if cell.compile:
            torch._dynamo.reset()  # every cell compiles a fresh model: drop the old one's code cache
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    status = "mismatch" if problems else ("tie" if ties else "ok")
    return CellResult(cell.label, status, "; ".join(problems), ties, time.perf_counter() - start)


def _setup_problems(engine: Engine, cell: Cell, opaque_calls: list) -> list[str]:
    """What the engine runs that the cell did not ask for (a silent fallback would pass otherwise)."""
    backends, problems = engine.backends, []
    got = (backends["attention"]["prefill"]["backend"], backends["attention"]["decode"]["backend"])
    if got != (cell.prefill, cell.decode):
        problems.append(f"attention backends {got}, expected {(cell.prefill, cell.decode)}")
    if cell.lora and backends.get("lora", {}).get("backend") != cell.lora:
        problems.append(f"LoRA backend {backends.get('lora')}, expected {cell.lora}")
    if cell.spec and engine.spec_worker.stats.steps == 0:
        problems.append(f"no speculative step ran under {cell.spec}")
    if cell.compile and not opaque_calls:
        problems.append("torch.compile on, but no compiled forward reached torch.ops.backplane.attention")
    # NOTE: on CPU, graphs on is logged and runs eagerly; torch_native decode declares no graph modes.
    on_gpu = engine.runner.device.type == "cuda"
    if cell.graphs and on_gpu and cell.decode != "torch_native" and engine.runner.graph_runner is None:
        problems.append("graphs on, but no CUDA graph was captured")
    return problems


def _count_extend_replays(engine: Engine) -> list[int]:
    """Wrap the target runner's graph replay (when graphs were captured): the list gets the number
    of tokens of every EXTEND batch that replays a graph."""
    graphs, counts = engine.runner.graph_runner, []
    if graphs is None:
        return counts
    replay = graphs.replay

    def counted(batch, key=None):
        if batch.forward_mode.value == "extend":
            counts.append(batch.num_tokens)
        return replay(batch, key)

    graphs.replay = counted
    return counts


def _extend_graph_problems(engine: Engine, cell: Cell, extend_replays: list[int]) -> list[str]:
    """--disable-extend-graph is taken as asked; with graphs on the GPU, EXTEND is captured (and
    the prefills replay) unless a plugin's declared limit says why not, and never when disabled."""
    runner = engine.runner
    if runner.args.disable_extend_graph == cell.extend_graphs:
        return [f"disable_extend_graph is {runner.args.disable_extend_graph}, the cell asked extend graphs "
                f"{'on' if cell.extend_graphs else 'off'}"]
    graphs = runner.graph_runner
    captured = graphs is not None and any(m.value == "extend" for m in graphs.kinds)
    if not cell.extend_graphs:
        return ["--disable-extend-graph, but EXTEND graphs were captured"] if captured or extend_replays else []
    if not (cell.graphs and runner.device.type == "cuda" and graphs is not None):
        return []
    limited = any(limit.mode == "extend" for limit in runner.graph_mode_limits)
    if not captured:
        return [] if limited else ["extend graphs on, but EXTEND was neither captured nor limited by a plugin"]
    return [] if extend_replays else ["EXTEND graphs captured, but no prefill replayed one"]


def compare(index: int, out, ref: Reference, tie_fraction: float) -> tuple[str | None, tuple | None]:
    """(problem or None, tie or None) for request `index` against its reference."""
    if out.error is not None:
        return f"request {index}: error {out.error}", None
    got, want = out.token_ids, ref.tokens
    j = next((p for p, (g, w) in enumerate(zip(got, want)) if g != w), None)
    if j is None:
        return (None, None) if len(got) == len(want) else (f"request {index}: {len(got)} tokens, expected {len(want)}", None)
    logits = ref.logits[j]
    margin = float((logits[want[j]] - logits[got[j]]) / logits.std())
    if margin <= tie_fraction:
        return None, (index, j, round(margin, 5))
    return (f"request {index}: token {j} is {got[j]}, reference {want[j]} (margin {margin:.3f} of the logits' std, "
            f"tie limit {tie_fraction}); got {got}, reference {want}"), None


def summary(results: list[CellResult]) -> dict:
    """Counts, every refusal with its line, every mismatch, each cell's time."""
    by = {s: [r for r in results if r.status == s] for s in ("ok", "tie", "refused", "mismatch")}
    return {
        "cells": len(results), **{s: len(v) for s, v in by.items()},
        "refusals": {r.label: r.message for r in by["refused"]},
        "mismatches": {r.label: r.message for r in by["mismatch"]},
        "ties": {r.label: r.ties for r in by["tie"]},
        "seconds": round(sum(r.seconds for r in results), 1),
        "results": [asdict(r) for r in results],
    }


def report(results: list[CellResult]) -> dict:
    """Print the summary and write it as JSON to $BACKPLANE_MATRIX_OUT when that is set."""
    doc = summary(results)
    print(f"\ncombination matrix: {doc['cells']} cells, {doc['ok']} equal, {doc['tie']} tie-only, "
          f"{doc['refused']} refused, {doc['mismatch']} mismatched, {doc['seconds']} s")
    for label, line in doc["refusals"].items():
        print(f"  refused  {label}: {line}")
    for label, line in doc["mismatches"].items():
        print(f"  MISMATCH {label}: {line}")
    path = os.environ.get(SUMMARY_ENV)
    if path:
        Path(path).write_text(json.dumps(doc, indent=1))
    return doc


def check(result: CellResult, expected_refusal: str | None = None) -> None:
    """Fail unless the cell matched (or tied), or was refused as expected with a one-line message."""
    if result.status == "refused":
        assert "\n" not in result.message and "--" in result.message, (
            f"{result.label}: a refusal must be one line naming the flags, got {result.message!r}")
        assert expected_refusal is not None and expected_refusal in result.message, (
            f"{result.label}: refused at startup: {result.message}")
        return
    assert expected_refusal is None, f"{result.label}: expected a refusal ({expected_refusal}), but it ran"
    assert result.status in ("ok", "tie"), f"{result.label}: {result.message}"


def matrix_fixtures(dirname: str):
    """The module-scoped `world` (models and adapters under a temporary `dirname`) and `results`
    (every cell's result, summarised by `report` when the module ends) fixtures of a matrix test."""

    @pytest.fixture(scope="module")
    def world(tmp_path_factory):
        return make_world(tmp_path_factory.mktemp(dirname))

    @pytest.fixture(scope="module")
    def results():
        collected = []
        yield collected
        if collected:
            report(collected)

    return world, results
