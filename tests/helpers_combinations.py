"""The plugin-combination matrix, shared by the CPU test (tests/test_combinations.py) and the GPU
test (tests/gpu/test_combinations_gpu.py).

A `Cell` is one combination: the model (a tiny Llama by default; `MODELS` has a Gemma 2 with
sliding-window layers interleaved with global ones and attention and final logit soft-caps, and a
Qwen3-MoE with 8 experts, top 2), prefill and decode attention backends, LoRA backend (or none),
speculative algorithm (or none), torch.compile, CUDA graphs, with graphs whether EXTEND is
captured too (extend graphs, off with --disable-extend-graph), for a MoE model the MoE backend
(--moe-backend, auto when unset), and the quantization (`QUANTS`: none, "fp8" = the checkpoint
quantized online per channel by quant_fp8, "fp8-block" = a block-wise FP8 checkpoint of the world's
model, "fp8-kv" = an FP8 KV cache). `run_cell` builds an Engine for it and generates greedily for one
mixed batch of the model's world (two adapters and base requests of different lengths and output
lengths; six or seven requests, so a batch pads up to a captured size of 8), then compares every
request with the fp32 Hugging Face reference (the PEFT-merged model for an adapter's requests).
A divergence passes only as a near-tie (`TieRule`): at the first differing token the reference's
logit of its own choice exceeds that of the engine's choice by at most a fraction of the logits'
standard deviation (so the reference's top two are that close); otherwise every token must be
equal. The reference of an FP8-weight cell is the fp32 model with the dequantized FP8 weights whose
quantized linears see their input quantized as quant_fp8 quantizes it (`quantized_world`); an fp8-kv
cell is compared with the plain reference; the FP8 tie rules are FP8_TIES and FP8_KV_TIES. A cell
whose Engine refuses the combination at startup (ValueError) is recorded as refused with that
message, which must be one line naming the flags.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import itertools
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from backplane import Engine, SamplingParams
from backplane.ops import opaque
from backplane.plugins.quant_fp8.reference import dequantized_input
from backplane.plugins.quant_fp8.scheme import Fp8Scheme
from helpers_models import hf_greedy, make_hf_model, save_exact_eagle_head, save_feature_eagle_head, tiny_hf_config
from lora_helpers import ADAPTERS, LoraWorld, save_adapted

sys.path.insert(0, str(Path(__file__).parent / "plugins" / "quant_fp8"))
import fp8_checkpoints  # noqa: E402

NAMES = ["all7_r4", "qv_down_r8"]
# One layer (the EAGLE head can reproduce it), head dim 64 (every attention backend serves it).
MODEL_SHAPE = dict(num_hidden_layers=1, hidden_size=128, intermediate_size=192, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=64)
# Motifs repeat so that ngram proposes, and verify accepts, several tokens per step.
PROMPTS = [[5, 17, 33] * 3, list(range(40, 51)), [7, 8] * 4, [101, 3, 250, 77], [12, 13, 14] * 2, [9]]
MIXED = ["all7_r4", None, "qv_down_r8", "all7_r4", None, "qv_down_r8"]
MAX_NEW = [8, 6, 7, 8, 5, 6]
# The Gemma and MoE worlds add a long request: past a kernel block, its sliding-window layers skip
# whole blocks of keys, and its prefill hands the MoE layer more tokens than a decode batch does.
LONG_PROMPT = [60, 61, 62, 63, 64, 65, 66, 67, 68] * 8 + [70, 71]  # 74 tokens
SPECS = {
    "ngram": dict(speculative_algorithm="ngram", speculative_num_draft_tokens=4),
    # a top-2 tree: verify runs a tree mask, not only a chain
    "eagle": dict(speculative_algorithm="eagle", speculative_num_steps=2, speculative_eagle_topk=2,
                  speculative_num_draft_tokens=4),
}
SUMMARY_ENV = "BACKPLANE_MATRIX_OUT"
# The quantization axis: None (the model dtype), "fp8" (--quantization fp8 of the world's checkpoint:
# per-channel weight scales, dynamic per-token activations), "fp8-block" (a block-wise FP8
# checkpoint: FP8_BLOCK weight blocks, dynamic 1 x FP8_BLOCK[1] activation groups), "fp8-kv"
# (--kv-cache-dtype fp8_e4m3, no checkpoint scales: 1.0 for every layer).
QUANTS = (None, "fp8", "fp8-block", "fp8-kv")
WEIGHT_QUANTS = ("fp8", "fp8-block")
# NOTE: 64 x 64, not fp8_checkpoints' 16 x 16: Triton's FP8 dot on CUDA needs K >= 32, so a
# 16-column block cannot run on the GPU. Both divide every projection of MODEL_SHAPE (K 128 and 192;
# fused parts 128, 64, 64 and 192, 192), so no block straddles two fused parts.
FP8_BLOCK = (64, 64)


@dataclass(frozen=True)
class ModelRecipe:
    """How a model's world is made. config: the transformers config (fp32, random weights drawn by
    helpers_models.make_hf_model, then `init` on the model); adapters: PEFT LoraConfig keywords by
    name, the first two used by the mixed batch; long: the world adds LONG_PROMPT; moe: the model
    has experts (its cells carry --moe-backend); exact_eagle: a one-layer Llama, whose EAGLE head can
    reproduce it (else a Llama head that is not a copy: `save_feature_eagle_head`)."""

    config: Callable[[], Any]
    adapters: dict[str, dict]
    long: bool = False
    moe: bool = False
    exact_eagle: bool = False
    init: Callable[[torch.nn.Module], None] | None = None


def _gemma2_config():
    import transformers

    # Layer 0 slides over 4 tokens (every prompt and output is longer), layer 1 is global; both
    # soft-caps bend the logits of these weights (attention scores reach ~6, final logits ~7).
    # Without the window, or without the attention soft-cap, 6 of the 7 requests' greedy tokens
    # change. The final soft-cap is monotonic: it moves logits and near-tie margins, never a token.
    return transformers.Gemma2Config(
        **MODEL_SHAPE | dict(num_hidden_layers=2), vocab_size=300, max_position_embeddings=512, rms_norm_eps=1e-6,
        layer_types=["sliding_attention", "full_attention"], sliding_window=4, attn_logit_softcapping=4.0,
        final_logit_softcapping=10.0, query_pre_attn_scalar=48, tie_word_embeddings=False,
        architectures=["Gemma2ForCausalLM"])


def _half_copy_head(model: torch.nn.Module) -> None:
    """lm_head = (random + embedding) / 2: the model repeats its last token about half the time (where
    EAGLE's head and ngram get drafts accepted) and the attention decides the other half. (A tied
    embedding makes a tiny random Gemma echo its input whatever attention does.)"""
    with torch.no_grad():
        model.lm_head.weight.mul_(0.5).add_(0.5 * model.model.embed_tokens.weight)


def _qwen3_moe_config():
    import transformers

    return transformers.Qwen3MoeConfig(
        **MODEL_SHAPE | dict(num_hidden_layers=2), vocab_size=300, max_position_embeddings=512, rms_norm_eps=1e-6,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
        tie_word_embeddings=False, architectures=["Qwen3MoeForCausalLM"])


def _sharp_router(model: torch.nn.Module) -> None:
    """Router weights 0.5 * randn, as tests/plugins/model_moe/test_moe_gpu.py draws them (where the
    MoE near-tie rule was calibrated): most tokens' top-k is a clear choice."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.copy_(0.5 * torch.randn_like(param))


ATTENTION_ONLY = ["q_proj", "k_proj", "v_proj", "o_proj"]
MODELS = {
    "llama": ModelRecipe(lambda: tiny_hf_config("LlamaForCausalLM", **MODEL_SHAPE),
                         {n: ADAPTERS[n] for n in NAMES}, exact_eagle=True),
    "gemma2": ModelRecipe(_gemma2_config, {n: ADAPTERS[n] for n in NAMES}, long=True, init=_half_copy_head),
    # LoRA of a MoE model serves the attention projections (on the experts it is refused).
    "qwen3_moe": ModelRecipe(_qwen3_moe_config, {
        "attn_r4": dict(r=4, lora_alpha=8, target_modules=ATTENTION_ONLY),
        "qv_r8": dict(r=8, lora_alpha=4, target_modules=["q_proj", "v_proj"], use_rslora=True),
    }, long=True, moe=True, init=_sharp_router),
}


@dataclass(frozen=True)
class Cell:
    """One plugin combination. lora / spec None: without adapters / speculation; moe: a MoE model's
    --moe-backend (None: auto); quant: one of QUANTS (None: unquantized)."""

    prefill: str
    decode: str
    lora: str | None = None
    spec: str | None = None
    compile: bool = False
    graphs: bool = False
    extend_graphs: bool = True  # False: --disable-extend-graph (only decode-like modes captured)
    model: str = "llama"
    moe: str | None = None
    quant: str | None = None

    def __post_init__(self):
        if self.model not in MODELS:
            raise ValueError(f"Cell model {self.model!r}: expected one of {sorted(MODELS)}")
        if self.moe is not None and not MODELS[self.model].moe:
            raise ValueError(f"Cell moe {self.moe!r}: model {self.model!r} has no experts")
        if self.quant not in QUANTS:
            raise ValueError(f"Cell quant {self.quant!r}: expected one of {QUANTS}")

    @property
    def label(self) -> str:
        """The cell's name in results; a Llama cell's has no model and an unquantized cell's no quant
        (older result files still match)."""
        attn = self.prefill if self.prefill == self.decode else f"{self.prefill}+{self.decode}"
        return (("" if self.model == "llama" else f"model={self.model} ")
                + f"attn={attn} lora={self.lora or 'none'} spec={self.spec or 'none'} "
                f"compile={'on' if self.compile else 'off'} graphs={'on' if self.graphs else 'off'}"
                + ("" if self.extend_graphs else " extend-graphs=off")
                + (f" moe={self.moe or 'auto'}" if MODELS[self.model].moe else "")
                + (f" quant={self.quant}" if self.quant else ""))

    @property
    def test_id(self) -> str:
        """The label in characters pytest's -k accepts: `-k "lora:triton and spec:eagle"`."""
        return self.label.replace("=", ":").replace(" ", "-")

    def engine_kwargs(self, world: MatrixWorld) -> dict:
        kw: dict = dict(prefill_attention_backend=self.prefill, decode_attention_backend=self.decode,
                        attention_backend=self.prefill, enable_torch_compile=self.compile,
                        disable_cuda_graph=not self.graphs, disable_extend_graph=not self.extend_graphs)
        if self.moe:
            kw["moe_backend"] = self.moe
        if self.quant == "fp8":
            kw["quantization"] = "fp8"  # "fp8-block": the variant's checkpoint says so (--quantization auto)
        if self.quant == "fp8-kv":
            kw["kv_cache_dtype"] = "fp8_e4m3"
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


@dataclass(frozen=True)
class TieRule:
    """When a divergence from the fp32 reference passes as a near-tie: at a request's first differing
    token, the reference's logit of its own choice exceeds that of the engine's choice by at most
    `fraction` of the reference logits' standard deviation, and, with `top`, the engine's choice is
    among the reference's `top` best; and at most `most_diverged` (a share) of a cell's requests
    diverge at all."""

    fraction: float
    top: int | None = None
    most_diverged: float = 1.0


# The FP8 tie rules, calibrated on CPU against the Llama world (783 teacher-forced positions of 67
# prompts; the margin of a flip: the reference's best logit over its logit of the engine's token, in
# the reference logits' std). An FP8 rounding moves a value by up to 2^-4 of itself, and a different
# rounding of one activation moves the next layer's inputs enough to round others differently, so
# the noise does not stay small where the engine computes in a narrower dtype than the reference:
# - FP8 weights (FP8_TIES, for a float16 engine: the GPU matrix). Against the dequantized-weight,
#   quantized-input reference (`quantized_world`), an fp32 engine is exact (TIES of 1e-3 holds, and
#   the CPU cells use it), but a float16 one flips the top token at 8-9% of positions, at margins up
#   to 0.22 (online, per channel) and 0.27 (64 x 64 blocks), the engine's token down to the
#   reference's fifth. So a divergence passes under 0.45 std (the largest margin and half again,
#   rounded up), at any rank. (A bfloat16 engine flips at up to 0.37; the Llama cells run in float16.)
#   Planted errors (tests/test_combinations.py) diverge by more: o_proj's block scales doubled at 0.68
#   and 0.98 of the std, online scales 1.25 times too large at 0.79.
# - FP8 KV cache (FP8_KV_TIES): compared with the plain reference (there is no transformers cache to
#   round), the cache's rounding flips the top token at 6-7% of positions, at margins up to 0.21 for
#   fp32, float16 and bfloat16 engines alike (the cache's rounding dominates): 0.35 std (half again,
#   rounded up), at any rank. A saturating K scale (planted) diverges at 0.47, 0.36 and 0.93.
FP8_TIES = TieRule(0.45)
FP8_KV_TIES = TieRule(0.35)


@dataclass
class Reference:
    """The fp32 reference of one request: greedy tokens and the logits each was chosen from."""

    tokens: list[int]
    logits: torch.Tensor  # [max_new, vocab]; row j: the distribution of token j


@dataclass
class MatrixWorld:
    """One model's saved checkpoint, its two adapters, the EAGLE head, its mixed batch (prompts,
    output lengths, adapter per request), and the references (computed once per (request, adapter)).
    lora.base_dir is the checkpoint the engine loads and lora.merged each adapter's reference model.
    quant: the weights' quantization of a variant (`variant`), None for the world as saved."""

    lora: LoraWorld
    eagle_head: str
    prompts: list[list[int]] = field(default_factory=lambda: list(PROMPTS))
    max_new: list[int] = field(default_factory=lambda: list(MAX_NEW))
    mixed: list[str | None] = field(default_factory=lambda: list(MIXED))
    references: dict[tuple[int, str | None], Reference] = field(default_factory=dict)
    quant: str | None = None
    variants: dict[str, MatrixWorld] = field(default_factory=dict, repr=False)

    def variant(self, quant: str | None) -> MatrixWorld:
        """The world a cell of quantization `quant` runs in: this one (unquantized weights, fp8-kv
        included), or its FP8-weight variant, made on first use (`quantized_world`)."""
        weights = quant if quant in WEIGHT_QUANTS else None
        if weights == self.quant:
            return self
        if self.quant is not None:
            raise ValueError(f"MatrixWorld.variant({quant!r}) of the {self.quant} variant: expected the world as saved")
        if weights not in self.variants:
            self.variants[weights] = quantized_world(self, weights)
        return self.variants[weights]

    def reference(self, index: int, adapter: str | None) -> Reference:
        key = (index, adapter)
        if key not in self.references:
            prompt = self.prompts[index]
            ids, logits = hf_greedy(self.lora.merged[adapter], prompt, self.max_new[index])
            self.references[key] = Reference(ids[len(prompt):], logits[len(prompt) - 1: -1])
        return self.references[key]


def make_world(root: Path, model: str = "llama") -> MatrixWorld:
    """The world of `model` (a key of MODELS), saved under `root`."""
    recipe = MODELS[model]
    base = make_hf_model(recipe.config(), seed=0)
    if recipe.init is not None:
        recipe.init(base)
    lora = save_adapted(base, root, recipe.adapters)
    if recipe.exact_eagle:
        head = save_exact_eagle_head(base, root / "eagle")
    else:
        head = save_feature_eagle_head(base.config, root / "eagle")
    first, second = list(recipe.adapters)[:2]
    mixed = [{"all7_r4": first, "qv_down_r8": second}.get(a) for a in MIXED]
    world = MatrixWorld(lora, head, mixed=mixed)
    if recipe.long:
        world.prompts.append(LONG_PROMPT)
        world.max_new.append(8)
        world.mixed.append(first)
    return world


def quantized_world(world: MatrixWorld, quant: str) -> MatrixWorld:
    """`world` with FP8 weights (`quant` "fp8" or "fp8-block"): the checkpoint the engine loads (the
    world's own for "fp8", quantized online per channel; a block-wise FP8 checkpoint written beside it
    for "fp8-block") and each adapter's reference: the fp32 model with every projection's dequantized
    FP8 weight, whose input is quantized and dequantized as the FP8 matmul quantizes it, under the
    adapter (PEFT, not merged: its LoRA delta reads the unquantized input, as over the FP8 base).

    NOTE: without the input quantization the reference would be off by the activations' FP8 rounding:
    for an fp32 engine a different top token at 12% of positions, at margins up to 0.41 of the
    logits' std (measured on CPU), a tie rule so wide that a wrong weight scale could pass. With it,
    an fp32 engine equals this reference to fp32 rounding."""
    base = world.lora.merged[None]
    if quant == "fp8":
        model_dir, scheme = world.lora.base_dir, Fp8Scheme(weights="channel", activations="token", online=True)
        state = {name: t.detach() for name, t in base.state_dict().items()}
        _, dequant = fp8_checkpoints.quantized_state(state, "channel")  # what --quantization fp8 makes
    else:
        model_dir = world.lora.base_dir.parent / quant
        scheme = Fp8Scheme(weights="block", activations="group", block=FP8_BLOCK, scale_name="weight_scale_inv")
        dequant = fp8_checkpoints.write_fp8_checkpoint(base, model_dir, "block", block=FP8_BLOCK)
    reference = _fp8_reference(base, dequant, scheme)
    models = {None: reference, **{name: _with_adapter(reference, path) for name, path in world.lora.adapter_dirs.items()}}
    return dataclasses.replace(world, lora=LoraWorld(model_dir, world.lora.adapter_dirs, models), references={},
                               quant=quant, variants={})


def _fp8_reference(base: torch.nn.Module, dequant: dict[str, torch.Tensor], scheme: Fp8Scheme) -> torch.nn.Module:
    """A copy of `base` with `dequant`'s weights (by module name), each of those linears' input seen
    as quant_fp8's matmul sees it under `scheme` (quantized, then dequantized, in fp32)."""
    reference = copy.deepcopy(base)
    modules = dict(reference.named_modules())
    for name, weight in dequant.items():
        with torch.no_grad():
            modules[name].weight.copy_(weight)
        modules[name].register_forward_pre_hook(lambda _module, args: (_fp8_input(scheme, args[0]),))
    return reference


def _fp8_input(scheme: Fp8Scheme, x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])  # [tokens, K]
    return dequantized_input(scheme, rows, None).reshape(x.shape).to(x.dtype)


def _with_adapter(model: torch.nn.Module, adapter_dir: Path) -> torch.nn.Module:
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(model), str(adapter_dir)).eval()


class Worlds(dict):
    """Model name -> MatrixWorld, each made (under `root`/<model>) when a cell first asks for it."""

    def __init__(self, root: Path):
        super().__init__()
        self.root = root

    def __missing__(self, model: str) -> MatrixWorld:
        world = self[model] = make_world(self.root / model, model)
        return world


STATUSES = ("ok", "tie", "refused", "mismatch", "error")


@dataclass
class CellResult:
    """status: "ok" (every token equal), "tie" (diverged at near-ties only), "refused" (at
    startup; message: the refusal), "mismatch" (message: what differs) or "error" (the cell raised:
    its exception's first line)."""

    label: str
    status: str
    message: str = ""
    ties: list = field(default_factory=list)  # (request, position, margin / std)
    seconds: float = 0.0
    acceptance: float | None = None  # speculative cells: tokens gained per request per verify step


@contextlib.contextmanager
def _count_opaque_calls(counter: list):
    """Count the opaque attention op's real calls (compiled forwards, captures included)."""
    real = opaque.bound_batch
    opaque.bound_batch = lambda layer: counter.append(1) or real(layer)
    try:
        yield
    finally:
        opaque.bound_batch = real


def run_cell(world: MatrixWorld, cell: Cell, ties: TieRule, **settings) -> CellResult:
    """Build the cell's Engine (with `settings`: device, dtype, pool sizes) in the world's variant of
    the cell's quantization, generate, compare."""
    start, calls, acceptance = time.perf_counter(), [], None
    world = world.variant(cell.quant)
    adapters = world.mixed if cell.lora else [None] * len(world.prompts)
    try:
        with _count_opaque_calls(calls):
            try:
                engine = Engine(str(world.lora.base_dir), **settings, **cell.engine_kwargs(world))
            except ValueError as exc:
                return CellResult(cell.label, "refused", str(exc), seconds=time.perf_counter() - start)
            params = [SamplingParams(max_new_tokens=m, temperature=0.0, ignore_eos=True) for m in world.max_new]
            extend_replays = _count_extend_replays(engine)
            outs = engine.generate(input_ids=world.prompts, sampling_params=params,
                                   lora=adapters if cell.lora else None)
        problems = _setup_problems(engine, cell, calls) + _extend_graph_problems(engine, cell, extend_replays)
        if cell.spec:
            acceptance = round(engine.spec_worker.stats.mean_acceptance_length, 3)
        problems, found = compare_all(outs, [world.reference(i, a) for i, a in enumerate(adapters)], ties, problems)
    finally:
        engine = None
        gc.collect()
        if cell.compile:
            torch._dynamo.reset()  # every cell compiles a fresh model: drop the old one's code cache
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    status = "mismatch" if problems else ("tie" if found else "ok")
    return CellResult(cell.label, status, "; ".join(problems), found, time.perf_counter() - start, acceptance)


def run_recorded(results: list[CellResult], world: MatrixWorld, cell: Cell, ties: TieRule, **settings) -> CellResult:
    """run_cell with its result appended to `results`; a cell that raises is recorded as "error"
    (the exception's first line) before the exception goes on, so the summary names every cell run."""
    start = time.perf_counter()
    try:
        result = run_cell(world, cell, ties, **settings)
    except Exception as exc:
        line = next(iter(str(exc).splitlines()), "")
        results.append(CellResult(cell.label, "error", f"{type(exc).__name__}: {line}"[:400],
                                  seconds=time.perf_counter() - start))
        raise
    results.append(result)
    return result


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
    return problems + _moe_problems(backends.get("moe"), cell, on_gpu) + _quant_problems(engine, cell)


def _moe_problems(moe: dict | None, cell: Cell, on_gpu: bool) -> list[str]:
    """A MoE model runs the MoE backend asked for; under `auto` with CUDA graphs, a graph-capable one."""
    if not MODELS[cell.model].moe:
        return [f"a dense model, but the engine built a MoE backend {moe}"] if moe else []
    if moe is None:
        return [f"model {cell.model} has experts, but the engine built no MoE backend"]
    if cell.moe and moe["backend"] != cell.moe:
        return [f"MoE backend {moe['backend']}, expected {cell.moe}"]
    if not cell.moe and cell.graphs and on_gpu and moe["backend"] == "torch_native":
        return ["--moe-backend auto chose torch_native (no graph support) with CUDA graphs on"]
    return []


def _quant_problems(engine: Engine, cell: Cell) -> list[str]:
    """The weights and the KV cache are quantized as the cell asks, and only then."""
    runner, problems = engine.runner, []
    methods = [m.quant_method for m in runner.model.modules() if getattr(m, "quant_method", None) is not None]
    schemes = {getattr(getattr(method, "scheme", None), "weights", type(method).__name__) for method in methods}
    want = {"fp8": {"channel"}, "fp8-block": {"block"}}.get(cell.quant, set())
    if schemes != want:
        problems.append(f"FP8 weight schemes {sorted(schemes)}, expected {sorted(want)}")
    if runner.token_to_kv_pool.is_fp8 != (cell.quant == "fp8-kv"):
        problems.append(f"KV cache of {runner.token_to_kv_pool.dtype} under quant {cell.quant}")
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


def compare_all(outs: list, refs: list[Reference], rule: TieRule, problems: list[str]) -> tuple[list[str], list]:
    """(`problems` with those of every request added, the near-ties found) for outputs against references."""
    problems, ties = list(problems), []
    for i, (out, ref) in enumerate(zip(outs, refs)):
        problem, tie = compare(i, out, ref, rule)
        problems += [problem] if problem else []
        ties += [tie] if tie else []
    most = int(len(outs) * rule.most_diverged)
    if len(ties) > most:
        problems.append(f"{len(ties)} of {len(outs)} requests diverged (each at a near-tie); at most {most} may")
    return problems, ties


def compare(index: int, out, ref: Reference, rule: TieRule) -> tuple[str | None, tuple | None]:
    """(problem or None, tie or None) for request `index` against its reference."""
    if out.error is not None:
        return f"request {index}: error {out.error}", None
    got, want = out.token_ids, ref.tokens
    j = next((p for p, (g, w) in enumerate(zip(got, want)) if g != w), None)
    if j is None:
        return (None, None) if len(got) == len(want) else (f"request {index}: {len(got)} tokens, expected {len(want)}", None)
    logits = ref.logits[j]
    margin = float((logits[want[j]] - logits[got[j]]) / logits.std())
    rank = int((logits > logits[got[j]]).sum())  # 0: the reference's own best
    if margin <= rule.fraction and (rule.top is None or rank < rule.top):
        return None, (index, j, round(margin, 5))
    limit = f"tie limit {rule.fraction}" + (f", the reference's top {rule.top}" if rule.top else "")
    return (f"request {index}: token {j} is {got[j]}, reference {want[j]} (margin {margin:.3f} of the logits' std, "
            f"rank {rank}; {limit}); got {got}, reference {want}"), None


def summary(results: list[CellResult]) -> dict:
    """Counts, every refusal with its line, every mismatch, each cell's time."""
    by = {s: [r for r in results if r.status == s] for s in STATUSES}
    return {
        "cells": len(results), **{s: len(v) for s, v in by.items()},
        "refusals": {r.label: r.message for r in by["refused"]},
        "mismatches": {r.label: r.message for r in by["mismatch"]},
        "errors": {r.label: r.message for r in by["error"]},
        "ties": {r.label: r.ties for r in by["tie"]},
        "seconds": round(sum(r.seconds for r in results), 1),
        "results": [asdict(r) for r in results],
    }


def report(results: list[CellResult]) -> dict:
    """Print the summary and write it as JSON to $BACKPLANE_MATRIX_OUT when that is set."""
    doc = summary(results)
    print(f"\ncombination matrix: {doc['cells']} cells, {doc['ok']} equal, {doc['tie']} tie-only, "
          f"{doc['refused']} refused, {doc['mismatch']} mismatched, {doc['error']} raised, {doc['seconds']} s")
    for label, line in doc["refusals"].items():
        print(f"  refused  {label}: {line}")
    for label, line in doc["mismatches"].items():
        print(f"  MISMATCH {label}: {line}")
    for label, line in doc["errors"].items():
        print(f"  ERROR    {label}: {line}")
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
    """The module-scoped `worlds` (a `Worlds`: each model's world made under a temporary `dirname`
    when a cell first asks for it) and `results` (every cell's result, summarised by `report` when
    the module ends) fixtures of a matrix test."""

    @pytest.fixture(scope="module")
    def worlds(tmp_path_factory):
        return Worlds(tmp_path_factory.mktemp(dirname))

    @pytest.fixture(scope="module")
    def results():
        collected = []
        yield collected
        if collected:
            report(collected)

    return worlds, results
