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
The other models (tests/helpers_combinations.py MODELS), attention triton / flashinfer /
torch_native (no splits), CUDA graphs off / on with extend graphs:
- Gemma 2 (layer 0 slides over 4 tokens, layer 1 global; attention and final logit soft-caps), float16:
  the full product attention x speculation x graphs x compile without LoRA (36 cells), and every
  pair of those axes with LoRA triton / torch_native (`pairwise`);
- Qwen3-MoE (8 experts, top 2), bfloat16 with `--moe-backend auto` (under graphs it must pick a
  graph-capable backend, triton): the same full product (36 cells) and LoRA pairs (adapters of the
  attention projections); and `--moe-backend torch_native` twice with graphs off (it runs) and once
  with graphs on (refused in one line at startup, as expected). Its divergences follow the MoE
  near-tie rule (MOE_TIES), not the dense one.
The quantization axis (tests/helpers_combinations.py QUANTS), Llama only, float16, attention
triton / flashinfer / torch_native, LoRA none / triton, speculation none / ngram / eagle, CUDA graphs
off / on with extend graphs, torch.compile off / on: for each of fp8 (online per-channel), fp8-block
(a 64 x 64 block-wise FP8 checkpoint) and fp8-kv (--kv-cache-dtype fp8_e4m3), every attention x
graphs pair in full and every pair of that with the other axes (`pairwise`, 18 cells each, 54 in
all). An FP8-weight cell is compared with the fp32 model of the dequantized weights and quantized
inputs under FP8_TIES, an fp8-kv cell with the plain reference under FP8_KV_TIES (both calibrated
and justified in tests/helpers_combinations.py). Unquantized cells are the ones above (quant none).
BACKPLANE_MATRIX_MODELS=llama,gemma2 keeps the cells of those models only (default: every model);
BACKPLANE_MATRIX_QUANT=none,fp8 those of these quantizations (none, fp8, fp8-block, fp8-kv).
BACKPLANE_MATRIX_SHARD=i/n runs every n-th cell from the i-th (`python -m bench.run matrix` runs
four shards side by side and merges their JSON into matrix.json), and BACKPLANE_MATRIX_OUT=path
writes the summary (cells, refusals with their lines, mismatches, ties, times) as JSON.
"""

from __future__ import annotations

import importlib.util
import itertools
import os

import pytest

from helpers_combinations import (FP8_KV_TIES, FP8_TIES, MODELS, QUANTS, WEIGHT_QUANTS, Cell, TieRule, check,
                                  matrix_fixtures, pairwise, run_recorded)

pytestmark = pytest.mark.gpu

ATTENTION = [("triton", "triton"), ("flashinfer", "flashinfer"), ("torch_native", "torch_native"),
             ("triton", "flashinfer"), ("flashinfer", "triton")]
LORA = [None, "triton", "torch_native"]
SPEC = [None, "ngram", "eagle"]
# (CUDA graphs, extend graphs): off; on with EXTEND captured; on with --disable-extend-graph.
GRAPHS = [(False, True), (True, True), (True, False)]
TIES = TieRule(0.05)  # of the reference logits' std: float16 rounding may flip a near-tie only
# MoE models only: bf16 rounding moves a token to another expert where two router logits are close,
# and transformers' own bf16 run parts from its fp32 run there by up to ~0.5 of the logits' spread.
# So (the rule calibrated in tests/plugins/model_moe/test_moe_gpu.py, same router draw): at a
# request's first divergence the engine's token is among the fp32 top 3 and within 0.25 std of the
# best, and at most three quarters of the requests diverge. A wrong kernel misses from the first token.
MOE_TIES = TieRule(0.25, top=3, most_diverged=0.75)
# Six or seven requests pad to the captured size 8, and to 2 once most have finished.
SETTINGS = dict(device="cuda", dtype="float16", max_total_tokens=4096, max_running_requests=8, cuda_graph_bs=[2, 8])
MOE_DTYPE = "bfloat16"  # the dtype MoE models are served in, and MOE_TIES was calibrated for
MODEL_ATTENTION = [("triton", "triton"), ("flashinfer", "flashinfer"), ("torch_native", "torch_native")]
MODEL_GRAPHS = [(False, True), (True, True)]
MODEL_LORA = ["triton", "torch_native"]
# (cell, the expected refusal's text): torch_native MoE has no graph support.
MOE_TORCH_NATIVE = [
    (Cell("triton", "triton", None, "eagle", model="qwen3_moe", moe="torch_native"), None),
    (Cell("flashinfer", "flashinfer", None, "ngram", True, model="qwen3_moe", moe="torch_native"), None),
    (Cell("triton", "triton", None, None, False, True, model="qwen3_moe", moe="torch_native"),
     "--moe-backend torch_native"),
]
QUANT_LORA = [None, "triton"]
# Cell label -> the expected refusal's text, for quantization cells the engine refuses at startup.
# None is expected: quant_fp8 declares LoRA, CUDA graphs and torch.compile; triton, flashinfer and
# torch_native attention each declare kv_cache_dtypes fp8_e4m3; EAGLE's draft keeps its own cache
# and weights in the model dtype. On CPU every combination of the axis with torch_native and triton
# attention, each LoRA backend, speculation, compile and graphs asked for ran (none refused).
QUANT_REFUSALS: dict[str, str] = {}


def _cells() -> list[Cell]:
    product = list(itertools.product(ATTENTION, LORA, SPEC, GRAPHS))
    cells = [Cell(*a, lora, spec, False, *graphs) for a, lora, spec, graphs in product]
    if os.environ.get("BACKPLANE_MATRIX_FULL") == "1":
        cells += [Cell(*a, lora, spec, True, *graphs) for a, lora, spec, graphs in product]
    else:
        axes = {"attention": ATTENTION, "lora": LORA, "spec": SPEC, "graphs": GRAPHS}
        cells += [Cell(*c["attention"], c["lora"], c["spec"], True, *c["graphs"]) for c in pairwise(axes)]
    cells += [cell for model in MODELS if model != "llama" for cell in _model_cells(model)]
    cells += [cell for cell, _ in MOE_TORCH_NATIVE]
    cells += [cell for quant in QUANTS if quant for cell in _quant_cells(quant)]
    models = _chosen("BACKPLANE_MATRIX_MODELS", list(MODELS))
    cells = [cell for cell in cells if cell.model in models]
    quants = _chosen("BACKPLANE_MATRIX_QUANT", [q or "none" for q in QUANTS])
    cells = [cell for cell in cells if (cell.quant or "none") in quants]
    shard = os.environ.get("BACKPLANE_MATRIX_SHARD")
    if shard:
        index, count = (int(v) for v in shard.split("/"))
        cells = cells[index::count]
    return cells


def _chosen(variable: str, names: list[str]) -> list[str]:
    """The comma-separated names of environment `variable` (all of `names` when unset); an unknown one is an error."""
    value = os.environ.get(variable)
    if not value:
        return names
    chosen = value.split(",")
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        raise ValueError(f"{variable}={value!r}: unknown {unknown}; expected names of {names}")
    return chosen


def _quant_cells(quant: str) -> list[Cell]:
    """The Llama cells of `quant`: every attention x graphs pair, each pair of it with LoRA,
    speculation and compile, and of those with each other (`pairwise`)."""
    axes = {"attention_graphs": list(itertools.product(MODEL_ATTENTION, MODEL_GRAPHS)), "lora": QUANT_LORA,
            "spec": SPEC, "compile": [False, True]}
    return [Cell(*c["attention_graphs"][0], c["lora"], c["spec"], c["compile"], *c["attention_graphs"][1], quant=quant)
            for c in pairwise(axes)]


def _model_cells(model: str) -> list[Cell]:
    """A model's cells beside the Llama's: the full product without LoRA, and LoRA by pairs."""
    axes = {"attention": MODEL_ATTENTION, "spec": SPEC, "graphs": MODEL_GRAPHS, "compile": [False, True]}
    cells = [Cell(*a, None, spec, compile, *graphs, model=model)
             for a, spec, graphs, compile in itertools.product(*axes.values())]
    pairs = pairwise({**axes, "lora": MODEL_LORA})
    return cells + [Cell(*c["attention"], c["lora"], c["spec"], c["compile"], *c["graphs"], model=model) for c in pairs]


def expected_refusal(cell: Cell) -> str | None:
    refusals = {**{c.label: refusal for c, refusal in MOE_TORCH_NATIVE}, **QUANT_REFUSALS}
    return refusals.get(cell.label)


def settings_of(cell: Cell) -> tuple[TieRule, dict]:
    """The cell's tie rule and Engine settings: a MoE model's are its own (bf16, MOE_TIES); an FP8
    cell's rule is FP8_TIES (weights) or FP8_KV_TIES (KV cache)."""
    if MODELS[cell.model].moe:
        return MOE_TIES, {**SETTINGS, "dtype": MOE_DTYPE}
    if cell.quant in WEIGHT_QUANTS:
        return FP8_TIES, SETTINGS
    return (FP8_KV_TIES if cell.quant == "fp8-kv" else TIES), SETTINGS


worlds, results = matrix_fixtures("matrix_gpu")


@pytest.mark.parametrize("cell", _cells(), ids=lambda c: c.test_id)
def test_cell(worlds, results, cell):
    if "flashinfer" in (cell.prefill, cell.decode) and importlib.util.find_spec("flashinfer") is None:
        pytest.skip("flashinfer is not installed")
    ties, settings = settings_of(cell)
    result = run_recorded(results, worlds[cell.model], cell, ties, **settings)
    check(result, expected_refusal(cell))
