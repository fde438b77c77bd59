"""Every plugin combination on the GPU, in float16 against the fp32 Hugging Face reference (PEFT-
merged per adapter), divergences allowed only at near-ties of the reference (the cell logic is
tests/helpers_combinations.py, shared with the CPU matrix tests/test_combinations.py).

Axes: attention triton / flashinfer / torch_native, and prefill and decode split both ways
(triton + flashinfer, flashinfer + triton); LoRA none / triton / torch_native; speculation
none / ngram / eagle; CUDA graphs off / on with extend graphs / on with --disable-extend-graph
(decode-like modes only); torch.compile off / on. With extend graphs, a cell also fails when EXTEND
is neither captured nor limited by a plugin's declaration, or captured but never replayed.
- compile off: the full product (5 x 3 x 3 x 3 = 135 cells);
- compile on: every pair of the other axes (`pairwise`), which keeps the whole matrix near six
  minutes (each compile cell compiles a fresh model per captured shape); with
  BACKPLANE_MATRIX_FULL=1, the full product (135 more cells, far slower).
BACKPLANE_MATRIX_SHARD=i/n runs every n-th cell from the i-th (`python -m bench.run matrix` runs
four shards side by side and merges their JSON into matrix.json), and BACKPLANE_MATRIX_OUT=path
writes the summary (cells, refusals with their lines, mismatches, ties, times) as JSON.
"""

from __future__ import annotations

import importlib.util
import itertools
import os

import pytest

from helpers_combinations import Cell, check, matrix_fixtures, pairwise, run_cell

pytestmark = pytest.mark.gpu

ATTENTION = [("triton", "triton"), ("flashinfer", "flashinfer"), ("torch_native", "torch_native"),
             ("triton", "flashinfer"), ("flashinfer", "triton")]
LORA = [None, "triton", "torch_native"]
SPEC = [None, "ngram", "eagle"]
# (CUDA graphs, extend graphs): off; on with EXTEND captured; on with --disable-extend-graph.
GRAPHS = [(False, True), (True, True), (True, False)]
TIE_FRACTION = 0.05  # of the reference logits' std: float16 rounding may flip a near-tie only
# Six requests pad to the captured size 8, and to 2 once most have finished.
SETTINGS = dict(device="cuda", dtype="float16", max_total_tokens=4096, max_running_requests=8, cuda_graph_bs=[2, 8])


def _cells() -> list[Cell]:
    product = list(itertools.product(ATTENTION, LORA, SPEC, GRAPHS))
    cells = [Cell(*a, lora, spec, False, *graphs) for a, lora, spec, graphs in product]
    if os.environ.get("BACKPLANE_MATRIX_FULL") == "1":
        cells += [Cell(*a, lora, spec, True, *graphs) for a, lora, spec, graphs in product]
    else:
        axes = {"attention": ATTENTION, "lora": LORA, "spec": SPEC, "graphs": GRAPHS}
        cells += [Cell(*c["attention"], c["lora"], c["spec"], True, *c["graphs"]) for c in pairwise(axes)]
    shard = os.environ.get("BACKPLANE_MATRIX_SHARD")
    if shard:
        index, count = (int(v) for v in shard.split("/"))
        cells = cells[index::count]
    return cells


world, results = matrix_fixtures("matrix_gpu")


@pytest.mark.parametrize("cell", _cells(), ids=lambda c: c.test_id)
def test_cell(world, results, cell):
    if "flashinfer" in (cell.prefill, cell.decode) and importlib.util.find_spec("flashinfer") is None:
        pytest.skip("flashinfer is not installed")
    result = run_cell(world, cell, TIE_FRACTION, **SETTINGS)
    results.append(result)
    check(result)
