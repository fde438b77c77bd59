"""Meta's fbgemm_fp8 and NVIDIA ModelOpt FP8 checkpoints, written here from a tiny random Llama as
those tools write them, load through quant_fp8 and match transformers' fp32 model with the weights
as the engine holds them, dequantized, and each linear's input quantized as the format says (written
here in plain torch):

- fbgemm_fp8: per-channel weight_scale [N, 1]; per token, scale = min(max |x|, activation_scale_ub)
  / 448 and larger values saturate at +-448 (transformers' FbgemmFp8Linear, fbgemm's
  quantize_fp8_per_row). The bound is set where it clamps some rows and not others.
- modelopt FP8: a scalar weight_scale per projection (a fused layer requantizes its parts to their
  largest, as vLLM does) and a static scalar input_scale, calibrated here on the prompt; its
  quantization in config.json or in hf_quant_config.json beside it; exclude_modules wildcards.

Planted errors fail each comparison (the bound ignored, a scale 25% off); excluded modules stay in the
model dtype; `--quantization auto` picks quant_fp8; a bad config is one line. And the bound inside
the Triton kernels: on CPU under Triton's interpreter, on CUDA in gpu-marked tests.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from backplane import Engine, SamplingParams
from backplane.contracts import QuantContext
from backplane.plugin.manager import load_plugins
from backplane.plugin.selection import QuantRequirements, select_quant_method
from backplane.plugins.quant_fp8 import kernels as qk
from backplane.plugins.quant_fp8 import quantize as fq
from backplane.plugins.quant_fp8.config import expert_quant_of, make_config
from backplane.plugins.quant_fp8.reference import reference_linear
from backplane.plugins.quant_fp8.scheme import Fp8Scheme

sys.path.insert(0, str(Path(__file__).parent))
from fp8_checkpoints import FUSED, PROJ, write_fp8_checkpoint  # noqa: E402
from helpers_models import hf_greedy, make_hf_model, tiny_hf_config  # noqa: E402

CPU = dict(device="cpu", dtype="float32", max_total_tokens=512)
PROMPT = [5, 17, 33, 2, 9, 120, 44]
STEPS = 6
GREEDY = SamplingParams(max_new_tokens=STEPS, temperature=0.0, ignore_eos=True)
FP8, FP8_MAX = torch.float8_e4m3fn, 448.0
# The tiny model's linear inputs have row maxima of about 0.6 to 3.4: this bound clamps some rows of
# every kind of layer and leaves others (checked in the test). Meta's checkpoints use 1200.
SCALE_UB = 2.5
# Meta's 405B checkpoint keeps attention (and the first and last layers' MLPs) in bf16.
FBGEMM_SKIP = ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj",
               "model.layers.0.self_attn.o_proj", "model.layers.1.mlp.down_proj", "lm_head")
MODELOPT_EXCLUDE = ("lm_head", "model.layers.1.self_attn*", "*.0.mlp.down_proj")


@pytest.fixture(scope="module")
def hf_model():
    return make_hf_model(tiny_hf_config("LlamaForCausalLM"), seed=3)


# -- the formats in plain torch ---------------------------------------------------------------------

def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def per_token_input(x: torch.Tensor, ub: float | None) -> torch.Tensor:
    """fbgemm's per-row quantization of x, dequantized: the row max bounded by ub before its scale."""
    rows = x.reshape(-1, x.shape[-1]).float()
    amax = rows.abs().amax(-1, keepdim=True)
    if ub is not None:
        amax = amax.clamp(max=ub)
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    return (to_fp8(rows, scale).float() * scale).reshape(x.shape).to(x.dtype)


def static_input(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (to_fp8(x, scale).float() * scale).to(x.dtype)


def projections(model) -> list[str]:
    return [name for name, _ in model.named_modules() if name.split(".")[-1] in PROJ]


def reference(hf_model, weights: dict[str, torch.Tensor], quantize_input):
    """`hf_model` with `weights` (dequantized, by module) whose linears see quantize_input(name, x)."""
    ref = copy.deepcopy(hf_model)
    modules = dict(ref.named_modules())
    for name, w in weights.items():
        with torch.no_grad():
            modules[name].weight.copy_(w)
        modules[name].register_forward_pre_hook(lambda _m, args, name=name: (quantize_input(name, args[0]),))
    return ref


def save_checkpoint(hf_model, path: Path, tensors: dict[str, torch.Tensor], quantization_config: dict | None,
                    hf_quant_config: dict | None = None) -> None:
    path.mkdir(parents=True, exist_ok=True)
    hf_model.config.save_pretrained(path)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config.pop("quantization_config", None)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if hf_quant_config is not None:
        (path / "hf_quant_config.json").write_text(json.dumps(hf_quant_config, indent=2))


def write_fbgemm(hf_model, path: Path, ub: float, skip=FBGEMM_SKIP) -> dict[str, torch.Tensor]:
    """An fbgemm_fp8 checkpoint: FP8 weight and fp32 weight_scale [N, 1] (max |row| / 448) of every
    projection not in `skip`. Returns the dequantized weights by module."""
    state = {n: t.detach().clone() for n, t in hf_model.state_dict().items()}
    dequant = {}
    for name in projections(hf_model):
        if name in skip:
            continue
        w = state[name + ".weight"].float()
        scale = w.abs().amax(1, keepdim=True) / FP8_MAX
        state[name + ".weight"], state[name + ".weight_scale"] = to_fp8(w, scale), scale
        dequant[name] = state[name + ".weight"].float() * scale
    save_checkpoint(hf_model, path, state, {"quant_method": "fbgemm_fp8", "activation_scale_ub": ub,
                                            "modules_to_not_convert": list(skip)})
    return dequant


def input_maxima(hf_model, prompt: list[int]) -> dict[str, float]:
    """ModelOpt's calibration: the largest |x| each projection sees over the prompt."""
    maxima, hooks = {}, []
    for name, module in hf_model.named_modules():
        if name.split(".")[-1] in PROJ:
            hooks.append(module.register_forward_pre_hook(
                lambda _m, args, name=name: maxima.__setitem__(name, float(args[0].abs().max()))))
    with torch.no_grad():
        hf_model(torch.tensor([prompt]))
    for hook in hooks:
        hook.remove()
    return maxima


def _group(name: str) -> str:
    layer, proj = name.rsplit(".", 1)
    return f"{layer}.{FUSED.get(proj, proj)}"


def write_modelopt(hf_model, path: Path, where: str, exclude=MODELOPT_EXCLUDE, weight_error: str | None = None):
    """A ModelOpt FP8 checkpoint: FP8 weight, scalar weight_scale (max |w| / 448) and input_scale (the
    calibrated max |x| / 448) of every projection no exclude pattern matches, and ModelOpt's k/v cache
    scales; the quantization in config.json or (where "hf_quant_config.json") beside it.
    Returns (the weights as the engine holds them, dequantized; the input scales), by module."""
    state = {n: t.detach().clone() for n, t in hf_model.state_dict().items()}
    maxima = input_maxima(hf_model, PROMPT)
    quantized = [n for n in projections(hf_model) if not any(fnmatch.fnmatchcase(n, p) for p in exclude)]
    scales, input_scales = {}, {}
    for name in quantized:
        w = state[name + ".weight"].float()
        scales[name] = w.abs().max() / FP8_MAX
        input_scales[name] = torch.tensor(maxima[name] / FP8_MAX)
        state[name + ".weight"] = to_fp8(w, scales[name])
        state[name + ".weight_scale"], state[name + ".input_scale"] = scales[name], input_scales[name]
    for layer in range(hf_model.config.num_hidden_layers):
        for proj in "kv":
            state[f"model.layers.{layer}.self_attn.{proj}_proj.{proj}_scale"] = torch.tensor(1.0)
    algo = {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": list(exclude)}
    if where == "config.json":
        save_checkpoint(hf_model, path, state, {"quant_method": "modelopt", **algo})
    else:
        save_checkpoint(hf_model, path, state, None, {"producer": {"name": "modelopt", "version": "0.19.0"},
                                                      "quantization": algo})
    return {n: engine_weight(n, state, scales) for n in quantized}, input_scales


def engine_weight(name: str, state: dict[str, torch.Tensor], scales: dict[str, torch.Tensor]) -> torch.Tensor:
    """The dequantized weight of projection `name`: a fused layer whose parts' scales differ keeps one
    scale, their largest, each part's FP8 weight requantized to it."""
    parts = [n for n in scales if _group(n) == _group(name)]
    top = max(scales[n] for n in parts)
    q, scale = state[name + ".weight"], scales[name]
    if all(scales[n] == top for n in parts):
        return q.float() * scale
    return to_fp8(q.float() * scale / top, 1.0).float() * top


# -- the engine against the references --------------------------------------------------------------

def engine_run(path):
    engine = Engine(str(path), **CPU)
    try:
        return engine, engine.generate(input_ids=[PROMPT], sampling_params=GREEDY)[0]
    finally:
        engine.shutdown()


def logprobs_of(logits: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    return torch.log_softmax(logits[len(PROMPT) - 1:-1], -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def check_against(out, ref) -> None:
    ids, logits = hf_greedy(ref, PROMPT, STEPS)
    assert out.token_ids == ids[len(PROMPT):]
    torch.testing.assert_close(torch.tensor(out.logprobs), logprobs_of(logits, out.token_ids), rtol=1e-4, atol=1e-4)


def differs_from(out, ref) -> bool:
    _, logits = hf_greedy(ref, PROMPT, STEPS)
    return not torch.allclose(torch.tensor(out.logprobs), logprobs_of(logits, out.token_ids), rtol=1e-3, atol=1e-3)


def layers_of(engine) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in engine.runner.model.named_modules() if getattr(m, "quant_method", None)}


def test_fbgemm_fp8_matches_the_reference_with_its_bound(hf_model, tmp_path):
    dequant = write_fbgemm(hf_model, tmp_path, SCALE_UB)
    engine, out = engine_run(tmp_path)
    rows = {"clamped": 0, "free": 0}

    def bounded(_name, x):
        amax = x.reshape(-1, x.shape[-1]).abs().amax(-1)
        rows["clamped"] += int((amax > SCALE_UB).sum())
        rows["free"] += int((amax <= SCALE_UB).sum())
        return per_token_input(x, SCALE_UB)

    check_against(out, reference(hf_model, dequant, bounded))
    assert rows["clamped"] > 0 and rows["free"] > 0  # the bound matters, and it is not a static scale
    # the planted errors: the bound ignored, or one output channel's scale 25% off
    assert differs_from(out, reference(hf_model, dequant, lambda _n, x: per_token_input(x, None)))
    planted = {**dequant, "model.layers.0.mlp.down_proj": dequant["model.layers.0.mlp.down_proj"].clone()}
    planted["model.layers.0.mlp.down_proj"][7] *= 1.25
    assert differs_from(out, reference(hf_model, planted, bounded))
    # modules_to_not_convert stay in the model dtype; the others are FP8 with [N, 1] scales and the bound
    layers = layers_of(engine)
    assert sorted(layers) == ["model.layers.0.mlp.down_proj", "model.layers.0.mlp.gate_up_proj",
                              "model.layers.1.mlp.gate_up_proj", "model.layers.1.self_attn.o_proj",
                              "model.layers.1.self_attn.qkv_proj"]
    assert all(m.quant_method.scheme.activation_scale_ub == SCALE_UB for m in layers.values())
    assert layers["model.layers.1.self_attn.qkv_proj"].weight_scale.shape == (128, 1)
    model = engine.runner.model.model
    assert model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32
    assert model.layers[1].mlp.down_proj.weight.dtype == torch.float32
    assert model.layers[1].mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn


def test_fbgemm_fp8_with_a_bound_no_row_reaches_is_the_per_channel_checkpoint(hf_model, tmp_path):
    """Meta's 1200 never clamps these activations: exactly compressed-tensors' per-channel FP8 of the
    same weights (the same bytes, per-token inputs)."""
    write_fbgemm(hf_model, tmp_path / "fbgemm", 1200.0, skip=("lm_head",))
    write_fp8_checkpoint(hf_model, tmp_path / "channel", "channel")
    _, got = engine_run(tmp_path / "fbgemm")
    _, want = engine_run(tmp_path / "channel")
    assert got.token_ids == want.token_ids and got.logprobs == want.logprobs


@pytest.mark.parametrize("where", ["config.json", "hf_quant_config.json"])
def test_modelopt_fp8_matches_the_reference(where, hf_model, tmp_path):
    weights, input_scales = write_modelopt(hf_model, tmp_path, where)
    engine, out = engine_run(tmp_path)
    check_against(out, reference(hf_model, weights, lambda name, x: static_input(x, input_scales[name])))
    # the planted error: one projection's weight scale 25% off
    planted = {**weights, "model.layers.1.mlp.down_proj": weights["model.layers.1.mlp.down_proj"] * 1.25}
    assert differs_from(out, reference(hf_model, planted, lambda name, x: static_input(x, input_scales[name])))
    # the wildcards keep layer 1's attention and layer 0's down_proj in the model dtype
    layers = layers_of(engine)
    assert sorted(layers) == ["model.layers.0.mlp.gate_up_proj", "model.layers.0.self_attn.o_proj",
                              "model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.down_proj",
                              "model.layers.1.mlp.gate_up_proj"]
    qkv = layers["model.layers.0.self_attn.qkv_proj"]
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight_scale.shape == () and qkv.input_scale.shape == ()
    assert qkv.quant_method.scheme == Fp8Scheme(weights="tensor", activations="tensor", static_input=True)
    model = engine.runner.model.model
    assert model.layers[1].self_attn.qkv_proj.weight.dtype == torch.float32
    assert model.layers[0].mlp.down_proj.weight.dtype == torch.float32
    assert engine.runner.model.lm_head.weight.dtype == torch.float32


def test_hf_quant_config_is_read_only_without_a_quantization_config(hf_model, tmp_path):
    from backplane.models.loader import load_hf_config, quantization_config_of

    write_modelopt(hf_model, tmp_path, "hf_quant_config.json")
    qc = quantization_config_of(load_hf_config(tmp_path))
    assert qc["quant_method"] == "modelopt" and qc["quantization"]["quant_algo"] == "FP8"
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert quantization_config_of(load_hf_config(tmp_path))["quant_method"] == "fbgemm_fp8"  # config.json wins
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}}))
    with pytest.raises(ValueError, match=r"hf_quant_config.json': expected a JSON object with a \"quantization\" "
                                         r"object .*got \{'producer'") as err:
        Engine(str(tmp_path), **CPU)
    assert "\n" not in str(err.value)


def test_auto_picks_quant_fp8_for_both_formats():
    registry = load_plugins().registry
    for fmt in ("fbgemm_fp8", "modelopt"):
        req = QuantRequirements(platform="cpu", dtype="float32", checkpoint_format=fmt)
        choice = select_quant_method(registry, "auto", req)
        assert choice.spec.name == "fp8" and choice.plugin == "quant_fp8"


# -- bad configs: one line naming the field -----------------------------------------------------------

@pytest.mark.parametrize("qc, message", [
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"},
     r"^quantization_config.quant_algo = 'NVFP4': quant_fp8 loads ModelOpt FP8 checkpoints \(per-tensor weight and "
     r"static input scales\); expected one of: FP8$"),
    ({"quant_method": "modelopt", "quantization": {"quant_algo": "INT4_AWQ"}},
     r"^quantization_config.quantization.quant_algo = 'INT4_AWQ': .*expected one of: FP8$"),
    ({"quant_method": "modelopt", "producer": {"name": "modelopt"}},
     r"^quantization_config.quant_algo = None: .*expected one of: FP8$"),
    ({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "NVFP4"},
     r"^quantization_config.kv_cache_quant_algo = 'NVFP4': expected 'FP8' or null"),
    ({"quant_method": "modelopt", "quant_algo": "FP8", "exclude_modules": "lm_head"},
     r"^quantization_config.exclude_modules = 'lm_head': expected a list of module names$"),
    ({"quant_method": "fbgemm_fp8", "activation_scale_ub": -1.0},
     r"^quantization_config.activation_scale_ub = -1.0: expected a number > 0, the bound on each token's max \|x\| "
     r"\(transformers' default 1200.0\)$"),
    ({"quant_method": "fbgemm_fp8", "activation_scale_ub": None}, r"^quantization_config.activation_scale_ub = None: "),
    ({"quant_method": "fbgemm_fp8", "modules_to_not_convert": [3]},
     r"^quantization_config.modules_to_not_convert = \[3\]: expected a list of module names$"),
])
def test_a_bad_config_is_one_line(qc, message):
    with pytest.raises(ValueError, match=message) as err:
        make_config(QuantContext(qc, torch.bfloat16, torch.device("cpu")))
    assert "\n" not in str(err.value)


def test_formats_read_into_their_schemes():
    fbgemm = make_config(QuantContext({"quant_method": "fbgemm_fp8", "modules_to_not_convert": ["lm_head"]},
                                      torch.bfloat16, torch.device("cpu")))
    assert fbgemm.scheme == Fp8Scheme(weights="channel", activations="token", activation_scale_ub=1200.0)
    assert fbgemm.ignore == ("lm_head",)  # transformers' default bound when the field is absent
    modelopt = make_config(QuantContext({"quant_method": "modelopt", "quant_algo": "fp8",
                                         "ignore": ["lm_head", "model.layers.*.mlp.gate"]},
                                        torch.bfloat16, torch.device("cpu")))
    assert modelopt.scheme.static_input and modelopt.ignore[0] == "lm_head"
    from backplane.contracts.quant import module_matches

    gate = modelopt.ignore[1]
    assert module_matches("model.layers.3.mlp.gate", gate) and not module_matches("model.layers.3.mlp.gate_proj", gate)


def test_the_bound_is_refused_for_moe_experts():
    scheme = Fp8Scheme(weights="channel", activations="token", activation_scale_ub=1200.0)
    with pytest.raises(ValueError, match=r"^quant_fp8: MoE layer model.layers.0.mlp.experts: per-token activations "
                                         r"bounded by activation_scale_ub 1200.0 \(fbgemm_fp8\) are not supported"):
        expert_quant_of(scheme, "model.layers.0.mlp.experts")
    with pytest.raises(ValueError, match=r"^Fp8Scheme: activation_scale_ub 1.0 with activations 'group': expected"):
        Fp8Scheme(weights="block", activations="group", block=(16, 16), activation_scale_ub=1.0)


# -- the bound inside the Triton kernels (CPU: Triton's interpreter) -----------------------------------

RECIPROCAL = torch.tensor(1 / FP8_MAX, dtype=torch.float32)  # what torch multiplies by on CUDA for `/ 448`


def bounded_like_cuda(x: torch.Tensor, ub: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token quantization as the kernels (and torch on CUDA) compute it: min(amax, ub) times the
    fp32 reciprocal of 448."""
    amax = x.float().abs().amax(-1, keepdim=True)
    if ub is not None:
        amax = amax.clamp(max=ub)
    scale = (amax * RECIPROCAL).clamp(min=fq.MIN_SCALE)
    return to_fp8(x, scale), scale


def rows_of_different_ranges(m: int, k: int, seed: int, device="cpu", dtype=torch.float32):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device=device) * (0.5 + torch.rand(m, 1, generator=gen, device=device) * 4)
    return x.to(dtype)


def bound_between(x: torch.Tensor) -> float:
    """A bound that clamps the rows above the median row max (at M = 1: half the row's max)."""
    amax = x.float().abs().amax(-1)
    return float(amax.median()) if x.shape[0] > 1 else float(amax[0]) / 2


@pytest.mark.parametrize("m, k", [(1, 300), (5, 200), (4, 70000)])  # 70000 > MAX_ROW: quantize.py's torch path
def test_quantize_rows_bounds_each_token(m, k):
    x = rows_of_different_ranges(m, k, seed=k)
    ub = bound_between(x)
    q, scale = qk.quantize_rows(x, scale_ub=ub)
    if k <= qk.MAX_ROW:
        want_q, want_scale = bounded_like_cuda(x, ub)
        assert torch.equal(scale, want_scale) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    ref_q, ref_scale = fq.quantize_per_token(x, ub)  # on this CPU a true division: equal up to the last bit
    torch.testing.assert_close(scale, ref_scale, rtol=2**-23, atol=0)
    assert float(scale.max()) <= ub * RECIPROCAL * (1 + 2**-23) and not torch.equal(scale, fq.quantize_per_token(x)[1])
    with pytest.raises(ValueError, match=r"^quantize_rows: scale_ub .* with group 16: expected none"):
        qk.quantize_rows(x[:, :64], 16, scale_ub=ub)


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("m", [1, 5])
def test_channel_matmul_bounds_each_token(m, fuse):
    n, k = 72, 200
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(m)) * 0.05
    q_w, s_w = fq.quantize_weight_per_channel(w)
    x = rows_of_different_ranges(m, k, seed=m + 1)
    ub = bound_between(x)
    launch = qk.Launch(block_n=32, block_k=64, split_k=2 if fuse else 1, fuse_quant=fuse)
    got = qk.channel_matmul(x, q_w, s_w, None, launch, scale_ub=ub)
    q, s = bounded_like_cuda(x, ub)
    same = (q.float() * s) @ (q_w.float() * s_w).t()
    torch.testing.assert_close(got, same, rtol=1e-5, atol=1e-5)
    scheme = Fp8Scheme(weights="channel", activations="token", activation_scale_ub=ub)
    torch.testing.assert_close(got, reference_linear(scheme, x, q_w, s_w, None, None), rtol=1e-2, atol=1e-2)
    unbounded = qk.channel_matmul(x, q_w, s_w, None, launch)
    assert not torch.allclose(got, unbounded, rtol=1e-2, atol=1e-2)  # the comparison above sees the bound


# -- the CUDA paths (gpu) --------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("m, k", [(1, 4096), (37, 14336), (3, 512)])
def test_quantize_rows_bounds_each_token_on_cuda(m, k):
    x = rows_of_different_ranges(m, k, seed=k, device="cuda", dtype=torch.bfloat16)
    ub = bound_between(x)
    q, scale = qk.quantize_rows(x, scale_ub=ub)
    want_q, want_scale = fq.quantize_per_token(x, ub)  # torch on CUDA: the kernels' numbers, bit for bit
    assert torch.equal(scale, want_scale) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert not torch.equal(scale, fq.quantize_per_token(x)[1])


@pytest.mark.gpu
@pytest.mark.parametrize("launch", [qk.Launch(64, 256, split_k=3, num_stages=4, fuse_quant=True),
                                    qk.Launch(64, 128, split_k=4, num_stages=4), qk.Launch(128, 128, num_warps=8)])
@pytest.mark.parametrize("m", [1, 17, 64])
def test_channel_matmul_bounds_each_token_on_cuda(m, launch):
    from backplane.plugins.quant_fp8 import cuda

    n, k = 384, 4096
    gen = torch.Generator(device="cuda").manual_seed(m)
    q_w, s_w = fq.quantize_weight_per_channel(torch.randn(n, k, device="cuda", generator=gen) * 0.05)
    x = rows_of_different_ranges(m, k, seed=m + 1, device="cuda", dtype=torch.bfloat16)
    ub = bound_between(x)
    scheme = Fp8Scheme(weights="channel", activations="token", activation_scale_ub=ub)
    ref = reference_linear(scheme, x.float(), q_w, s_w, None, None)
    paths = {"kernel": qk.channel_matmul(x, q_w, s_w, None, launch, scale_ub=ub),
             "cuda_linear": cuda.cuda_linear(scheme, x, q_w, s_w, None, None),
             "scaled_mm": cuda._rowwise(scheme, x, q_w, s_w, None, None)}
    unbounded = reference_linear(Fp8Scheme(weights="channel", activations="token"), x.float(), q_w, s_w, None, None)
    for name, got in paths.items():
        assert got.dtype == torch.bfloat16 and got.shape == (m, n), name
        torch.testing.assert_close(got.float(), ref, rtol=1.6e-2, atol=1e-2, msg=name)
        assert not torch.allclose(got.float(), unbounded, rtol=1.6e-2, atol=1e-2), name  # the bound is seen
