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
The other models (tests/helpers_combinations.py MODELS: a Gemma 2 with a 4-token sliding window on
layer 0 and attention and final logit soft-caps, a Qwen3-MoE with 8 experts, top 2, its MoE on
torch_native, the only CPU MoE backend) get a smaller subset, ~35 s together:
- torch_native attention: LoRA {none, torch_native} x speculation {none, ngram, eagle} (6 cells each);
- Gemma: one triton cell (ngram: the interpreted kernels' window and soft-cap under verify);
  Qwen3-MoE: LoRA triton (attention projections) with EAGLE, and one torch.compile cell
  (`--moe-backend auto`, through the opaque MoE op). The MoE model's attention is the Llama one, which
  the triton attention cells above cover.
The quantization axis (tests/helpers_combinations.py QUANTS), Llama only, torch_native attention but
for one triton cell, ~10 s together with the planted errors: fp8 (online per-channel) without LoRA or
speculation and with LoRA triton and EAGLE; fp8-block (a 64 x 64 block-wise FP8 checkpoint) with
LoRA torch_native and ngram; fp8-kv with LoRA torch_native and EAGLE, and on triton attention with
ngram. An FP8-weight cell must equal the dequantized-weight, quantized-input fp32 reference as
exactly as an unquantized cell (TIES: the CPU computes in fp32 what the reference computes), an
fp8-kv cell the plain reference within FP8_KV_TIES; and planted scale errors (a block-wise
checkpoint's scale, the online quantizer's, a KV cache scale) fail their cell under the GPU's looser
rules too. No CPU combination of the axis is refused (every one was tried: torch_native and triton
attention, each LoRA backend and speculative algorithm, compile, graphs asked for).
Cells failing by a known bug are listed in KNOWN_BUGS (strict xfail: fixed, they fail until removed).
The full product, graphs and compile with every backend, runs on the GPU.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import pytest

import torch
from safetensors.torch import load_file, save_file

from backplane.plugins.quant_fp8 import quantize as fq
from helpers_combinations import (FP8_KV_TIES, FP8_TIES, MODELS, PROMPTS, Cell, CellResult, MatrixWorld, Reference,
                                  TieRule, check, compare, compare_all, matrix_fixtures, pairwise, run_cell, run_recorded)
from lora_helpers import LoraWorld

LORA = [None, "torch_native", "triton"]
SPEC = [None, "ngram", "eagle"]
SPLITS = [("triton", "triton"), ("triton", "torch_native"), ("torch_native", "triton")]
TIES = TieRule(1e-3)  # fp32 against fp32: only an exact-arithmetic near-tie may flip

CELLS = (
    [Cell("torch_native", "torch_native", lora, spec) for lora in LORA for spec in SPEC]
    + [Cell("torch_native", "torch_native", lora, spec, compile=True) for lora, spec in zip(LORA, SPEC)]
    + [Cell(*c["attention"], c["lora"], c["spec"]) for c in pairwise({"attention": SPLITS, "lora": LORA, "spec": SPEC})]
    + [Cell("torch_native", "torch_native", "torch_native", "ngram", graphs=True)]
    + [Cell("torch_native", "torch_native", None, "ngram", graphs=True, extend_graphs=False)]
    + [Cell("torch_native", "torch_native", lora, spec, model="gemma2") for lora in LORA[:2] for spec in SPEC]
    + [Cell("triton", "triton", None, "ngram", model="gemma2")]
    + [Cell("torch_native", "torch_native", lora, spec, model="qwen3_moe", moe="torch_native")
       for lora in LORA[:2] for spec in SPEC]
    + [Cell("torch_native", "torch_native", "triton", "eagle", model="qwen3_moe", moe="torch_native")]
    + [Cell("torch_native", "torch_native", None, "ngram", compile=True, model="qwen3_moe")]
    + [Cell("torch_native", "torch_native", quant="fp8"), Cell("torch_native", "torch_native", "triton", "eagle", quant="fp8"),
       Cell("torch_native", "torch_native", "torch_native", "ngram", quant="fp8-block"),
       Cell("torch_native", "torch_native", "torch_native", "eagle", quant="fp8-kv"),
       Cell("triton", "triton", None, "ngram", quant="fp8-kv")]
)
# NOTE: known bugs, each cell failing deterministically (strict: a fix makes it fail until removed here).
KNOWN_BUGS: dict[str, str] = {}
SETTINGS = dict(device="cpu", dtype="float32", max_total_tokens=1024, max_running_requests=8)


worlds, results = matrix_fixtures("matrix")


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


def test_model_axis_labels_and_worlds():
    """A Llama cell's label has no model (older result files match); others name the model, and a MoE
    model's its MoE backend. Each world's config keeps its architecture's features on."""
    assert Cell("triton", "triton").label == "attn=triton lora=none spec=none compile=off graphs=off"
    assert Cell("triton", "triton", model="gemma2").label.startswith("model=gemma2 attn=triton ")
    assert Cell("triton", "triton", model="qwen3_moe").label.endswith("graphs=off moe=auto")
    assert Cell("triton", "triton", model="qwen3_moe", moe="triton").engine_kwargs(None)["moe_backend"] == "triton"
    with pytest.raises(ValueError, match="model 'gemma2' has no experts"):
        Cell("triton", "triton", model="gemma2", moe="triton")
    with pytest.raises(ValueError, match="expected one of"):
        Cell("triton", "triton", model="gemma9")
    gemma = MODELS["gemma2"].config()
    sliding = [i for i, t in enumerate(gemma.layer_types) if t == "sliding_attention"]
    assert sliding and len(sliding) < gemma.num_hidden_layers  # interleaved with a global layer
    assert gemma.sliding_window < sum(len(p) for p in PROMPTS[:3]) / 3  # it cuts most prompts already
    assert gemma.attn_logit_softcapping and gemma.final_logit_softcapping
    moe = MODELS["qwen3_moe"].config()
    assert (moe.num_experts, moe.num_experts_per_tok, MODELS["qwen3_moe"].moe) == (8, 2, True)
    assert all(set(a["target_modules"]) <= {"q_proj", "k_proj", "v_proj", "o_proj"}
               for a in MODELS["qwen3_moe"].adapters.values())


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
    assert compare(0, out, ref, TIES) == (None, None)
    out.token_ids = [2, 5, 6]
    problem, tie = compare(0, out, ref, TIES)
    assert problem is None and tie[:2] == (0, 1)
    out.token_ids = [3, 4, 1]
    problem, tie = compare(0, out, ref, TIES)
    assert tie is None and "token 0 is 3, reference 2" in problem
    out.token_ids = [2, 4]
    assert "2 tokens, expected 3" in compare(0, out, ref, TIES)[0]
    # The MoE rule (the GPU's, for router flips): a looser margin, within the top `top`, and not
    # every request may diverge.
    loose = TieRule(0.5, top=2, most_diverged=0.5)
    logits[0, 3] = 4.9  # request 0, token 0: 3 is a near-tie of 2, rank 1
    out.token_ids = [3, 4, 1]
    assert compare(0, out, ref, loose)[1] is not None and compare(0, out, ref, TieRule(0.5, top=1))[0] is not None
    problems, ties = compare_all([out, out], [ref, ref], loose, [])
    assert len(ties) == 2 and problems == ["2 of 2 requests diverged (each at a near-tie); at most 1 may"]
    refused = CellResult("cell", "refused", "--lora-backend x: unusable with --speculative-algorithm y")
    check(refused, expected_refusal="unusable")
    with pytest.raises(AssertionError, match="refused at startup"):
        check(refused)
    with pytest.raises(AssertionError, match="one line naming the flags"):
        check(CellResult("cell", "refused", "no flag here"), expected_refusal="no flag")
    with pytest.raises(AssertionError, match="token 3"):
        check(CellResult("cell", "mismatch", "request 0: token 3 ..."))


def test_a_cell_that_raises_is_recorded_as_an_error(monkeypatch):
    """A cell whose engine raises (not a refusal) still reaches the matrix summary, as "error" with the
    exception's first line; the exception goes on to fail the test."""
    import helpers_combinations as hc

    def raising(*args, **kwargs):
        raise RuntimeError("CUDA graph capture failed at 8 requests x 512 tokens\ntraceback lines")

    monkeypatch.setattr(hc, "run_cell", raising)
    results = []
    with pytest.raises(RuntimeError, match="capture failed"):
        run_recorded(results, None, Cell("triton", "triton", None, None), TIES)
    (result,) = results
    assert (result.status, result.message) == ("error", "RuntimeError: CUDA graph capture failed at 8 requests x 512 tokens")
    doc = hc.summary(results)
    assert (doc["cells"], doc["error"], doc["ok"]) == (1, 1, 0) and doc["errors"] == {result.label: result.message}


def test_quant_axis_labels_and_flags():
    """The axis shows in the label only when set (older labels stay) and reaches the Engine's flags."""
    assert Cell("triton", "triton").label.endswith("graphs=off")
    assert Cell("triton", "triton", quant="fp8-block").test_id.endswith("graphs:off-quant:fp8-block")
    assert Cell("triton", "triton", quant="fp8").engine_kwargs(None)["quantization"] == "fp8"
    assert Cell("triton", "triton", quant="fp8-kv").engine_kwargs(None)["kv_cache_dtype"] == "fp8_e4m3"
    assert not {"quantization", "kv_cache_dtype"} & set(Cell("triton", "triton", quant="fp8-block").engine_kwargs(None))
    with pytest.raises(ValueError, match="expected one of"):
        Cell("triton", "triton", quant="int4")


def _planted(world: MatrixWorld, quant: str | None, root, change) -> MatrixWorld:
    """`world`'s `quant` variant loading a copy of its checkpoint whose tensors `change` altered (in
    place, by name), compared with the variant's own (right) references."""
    variant = world.variant(quant)
    path = root / f"planted-{quant or 'none'}"
    shutil.copytree(variant.lora.base_dir, path)
    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return dataclasses.replace(variant, lora=LoraWorld(path, variant.lora.adapter_dirs, variant.lora.merged))


def _mismatch(world: MatrixWorld, cell: Cell, rule: TieRule) -> str:
    """The cell's mismatch message under `rule` (a GPU rule: looser than the CPU's TIES, so a cell
    failing it fails TIES too); an assertion error if the cell passed."""
    result = run_cell(world, cell, rule, **SETTINGS)
    assert result.status == "mismatch", f"{cell.label}: the planted error passed: {result.status} {result.ties}"
    return result.message


def test_a_wrong_block_scale_fails_its_cell(worlds, tmp_path):
    """A block-wise checkpoint whose o_proj scales are doubled (every other scale right)
    diverges from the dequantized reference beyond the CPU's rule and the GPU's FP8 rule."""
    def double(tensors):
        tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"] *= 2

    planted = _planted(worlds["llama"], "fp8-block", tmp_path, double)
    assert f"tie limit {FP8_TIES.fraction}" in _mismatch(planted, Cell("torch_native", "torch_native", quant="fp8-block"),
                                                           FP8_TIES)


def test_a_wrong_online_scale_fails_its_cell(worlds, monkeypatch):
    """--quantization fp8 whose per-channel scales come out 1.25 times too large."""
    world = worlds["llama"]
    world.variant("fp8")  # the reference, quantized right before the quantizer goes wrong
    right = fq.quantize_weight_per_channel

    def wrong(w):
        q, scale = right(w)
        return q, scale * 1.25

    monkeypatch.setattr(fq, "quantize_weight_per_channel", wrong)
    assert f"tie limit {FP8_TIES.fraction}" in _mismatch(world, Cell("torch_native", "torch_native", quant="fp8"), FP8_TIES)


def test_a_wrong_kv_scale_fails_its_cell(worlds, tmp_path):
    """An FP8 KV cache whose layer-0 K scale (read from the checkpoint) is 1/500: keys saturate."""
    world = worlds["llama"]
    planted = _planted(world, None, tmp_path, lambda t: t.update({"model.layers.0.self_attn.k_scale": torch.tensor(0.002)}))
    assert f"tie limit {FP8_KV_TIES.fraction}" in _mismatch(planted, Cell("torch_native", "torch_native", quant="fp8-kv"),
                                                              FP8_KV_TIES)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU run of Triton needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("cell", [
    pytest.param(c, marks=pytest.mark.xfail(reason=KNOWN_BUGS[c.label], strict=True)) if c.label in KNOWN_BUGS else c
    for c in CELLS], ids=lambda c: c.test_id)
def test_cell(worlds, results, cell):
    result = run_recorded(results, worlds[cell.model], cell, FP8_KV_TIES if cell.quant == "fp8-kv" else TIES, **SETTINGS)
    check(result)
