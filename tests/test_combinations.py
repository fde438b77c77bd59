"""Every plugin combination, the CPU part: each cell generates greedily for one mixed batch (two
adapters and base requests) and must equal the fp32 Hugging Face reference (PEFT-merged per
adapter) token for token, a divergence allowed only at a near-tie of the reference (tests/
helpers_combinations.py has the cell logic, shared with tests/gpu/test_combinations_gpu.py).

CPU has no CUDA graphs (the engine logs that and runs eagerly), so graphs are off here but for
one cell that asks for them (LoRA torch_native with ngram) and must run eagerly with the same
output. The extend-graphs axis matters only where graphs are captured (the GPU); here one cell
(ngram, graphs asked for) passes --disable-extend-graph, which must be accepted and change nothing. The cells are a subset that keeps the matrix near a minute on two cores:
- torch_native attention: the full product LoRA {none, torch_native, triton} x speculation
  {none, ngram, eagle}, compile off (9 cells);
- torch.compile (torch_native only: compiled attention on CPU is the torch_native backend): the
  speculation axis once each, with LoRA none / torch_native / triton (3 cells);
- triton attention (interpreted, slow): every pair of {triton, triton prefill + torch_native
  decode, torch_native prefill + triton decode} x LoRA x speculation (10 cells, see `pairwise`).
The full product, graphs and compile with every backend, runs on the GPU.
"""

from __future__ import annotations

import os

import pytest

import torch

from helpers_combinations import Cell, CellResult, Reference, check, compare, matrix_fixtures, pairwise, run_cell

LORA = [None, "torch_native", "triton"]
SPEC = [None, "ngram", "eagle"]
SPLITS = [("triton", "triton"), ("triton", "torch_native"), ("torch_native", "triton")]
TIE_FRACTION = 1e-3  # fp32 against fp32: only an exact-arithmetic near-tie may flip

CELLS = (
    [Cell("torch_native", "torch_native", lora, spec) for lora in LORA for spec in SPEC]
    + [Cell("torch_native", "torch_native", lora, spec, compile=True) for lora, spec in zip(LORA, SPEC)]
    + [Cell(*c["attention"], c["lora"], c["spec"]) for c in pairwise({"attention": SPLITS, "lora": LORA, "spec": SPEC})]
    + [Cell("torch_native", "torch_native", "torch_native", "ngram", graphs=True)]
    + [Cell("torch_native", "torch_native", None, "ngram", graphs=True, extend_graphs=False)]
)
SETTINGS = dict(device="cpu", dtype="float32", max_total_tokens=1024, max_running_requests=8)


world, results = matrix_fixtures("matrix")


def test_pairwise_covers_every_pair():
    axes = {"attention": SPLITS, "lora": LORA, "spec": SPEC}
    chosen = pairwise(axes)
    assert len(chosen) <= 10  # 9 is the least for three axes of three; the greedy is one over
    for a, b in [("attention", "lora"), ("attention", "spec"), ("lora", "spec")]:
        assert {(c[a], c[b]) for c in chosen} == {(x, y) for x in axes[a] for y in axes[b]}


def test_extend_graph_axis_in_labels_and_flags():
    """The axis shows in the label only when off (older labels stay) and reaches the Engine's flag."""
    on, off = Cell("triton", "triton", graphs=True), Cell("triton", "triton", graphs=True, extend_graphs=False)
    assert on.label.endswith("graphs=on") and off.label.endswith("graphs=on extend-graphs=off")
    assert on.engine_kwargs(None)["disable_extend_graph"] is False
    assert off.engine_kwargs(None)["disable_extend_graph"] is True
    assert len({c.label for c in CELLS}) == len(CELLS)


def test_tie_rule_and_refusal_lines():
    """A divergence passes only where the reference's top two are within the tie limit; a refusal
    passes only when expected and one line naming a flag."""
    logits = torch.zeros(3, 8)
    logits[0, 2], logits[1, 4], logits[1, 5] = 5.0, 3.0, 3.0 - 1e-6  # step 1: a near-tie of 4 and 5
    ref = Reference([2, 4, 1], logits)

    class Out:
        error = None
        token_ids: list = []

    out = Out()
    out.token_ids = [2, 4, 1]
    assert compare(0, out, ref, TIE_FRACTION) == (None, None)
    out.token_ids = [2, 5, 6]
    problem, tie = compare(0, out, ref, TIE_FRACTION)
    assert problem is None and tie[:2] == (0, 1)
    out.token_ids = [3, 4, 1]
    problem, tie = compare(0, out, ref, TIE_FRACTION)
    assert tie is None and "token 0 is 3, reference 2" in problem
    out.token_ids = [2, 4]
    assert "2 tokens, expected 3" in compare(0, out, ref, TIE_FRACTION)[0]
    refused = CellResult("cell", "refused", "--lora-backend x: unusable with --speculative-algorithm y")
    check(refused, expected_refusal="unusable")
    with pytest.raises(AssertionError, match="refused at startup"):
        check(refused)
    with pytest.raises(AssertionError, match="one line naming the flags"):
        check(CellResult("cell", "refused", "no flag here"), expected_refusal="no flag")
    with pytest.raises(AssertionError, match="token 3"):
        check(CellResult("cell", "mismatch", "request 0: token 3 ..."))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU run of Triton needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c.test_id)
def test_cell(world, results, cell):
    result = run_cell(world, cell, TIE_FRACTION, **SETTINGS)
    results.append(result)
    check(result)
