"""quant_fp8 on CPU: FP8 checkpoints written here (compressed-tensors per-channel and per-tensor,
block-wise fp8) load through the engine and match transformers' model with the dequantized weights
and the same activation quantization; selection (auto, explicit, none) and its one-line refusals;
the ignore list; online quantization; tensor parallelism (gloo, 2 ranks) equal to one rank."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from backplane import Engine, SamplingParams
from backplane.plugin.manager import load_plugins
from backplane.plugin.selection import QuantRequirements, SelectionError, select_quant_method
from backplane.plugins.quant_fp8.method import Fp8LinearMethod

sys.path.insert(0, str(Path(__file__).parent))
from fp8_checkpoints import reference_model, write_fp8_checkpoint  # noqa: E402
from helpers_models import hf_greedy, make_hf_model, tiny_hf_config  # noqa: E402

CPU = dict(device="cpu", dtype="float32", max_total_tokens=512)
PROMPT = [5, 17, 33, 2, 9, 120, 44]
STEPS = 6
GREEDY = SamplingParams(max_new_tokens=STEPS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_model():
    return make_hf_model(tiny_hf_config("LlamaForCausalLM"), seed=3)


def engine_greedy(path, **kwargs):
    engine = Engine(str(path), **CPU, **kwargs)
    try:
        out = engine.generate(input_ids=[PROMPT], sampling_params=GREEDY)[0]
        return engine, out
    finally:
        engine.shutdown()


def quantized_layers(engine) -> dict[str, Fp8LinearMethod]:
    return {n: m.quant_method for n, m in engine.runner.model.named_modules() if getattr(m, "quant_method", None)}


@pytest.mark.parametrize("fmt", ["channel", "tensor", "block"])
def test_fp8_checkpoint_matches_the_dequantized_reference(fmt, hf_model, tmp_path):
    dequant = write_fp8_checkpoint(hf_model, tmp_path, fmt)
    ids, logits = hf_greedy(reference_model(hf_model, dequant, fmt), PROMPT, STEPS)
    engine, out = engine_greedy(tmp_path)
    assert out.token_ids == ids[len(PROMPT):]
    expected = torch.log_softmax(logits[len(PROMPT) - 1:-1], -1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.logprobs), expected, rtol=1e-4, atol=1e-4)
    layers = quantized_layers(engine)
    assert len(layers) == 2 * 4 and all(m.scheme.weights == fmt for m in layers.values())  # qkv, o, gate_up, down
    assert engine.runner.model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    assert engine.runner.model.lm_head.weight.dtype == torch.float32  # kept in the model dtype
    # the planted error: the dequantized reference with one scale wrong gives other logits
    planted = {**dequant, "model.layers.0.mlp.down_proj": dequant["model.layers.0.mlp.down_proj"] * 1.5}
    assert not torch.allclose(hf_greedy(reference_model(hf_model, planted, fmt), PROMPT, STEPS)[1], logits, atol=1e-3)


def test_ignore_list_keeps_those_layers_in_high_precision(hf_model, tmp_path):
    ignore = ("model.layers.1.mlp.down_proj", "re:.*layers\\.0\\.self_attn\\.[qkv]_proj")
    dequant = write_fp8_checkpoint(hf_model, tmp_path, "channel", ignore)
    ids, _ = hf_greedy(reference_model(hf_model, dequant, "channel"), PROMPT, STEPS)
    engine, out = engine_greedy(tmp_path)
    assert out.token_ids == ids[len(PROMPT):]
    layers = quantized_layers(engine)
    assert "model.layers.1.mlp.down_proj" not in layers and "model.layers.0.self_attn.qkv_proj" not in layers
    assert "model.layers.0.mlp.down_proj" in layers and len(layers) == 6
    assert engine.runner.model.model.layers[1].mlp.down_proj.weight.dtype == torch.float32


def test_ignoring_part_of_a_fused_layer_is_one_line(hf_model, tmp_path):
    write_fp8_checkpoint(hf_model, tmp_path, "channel", ("model.layers.0.self_attn.q_proj",))
    with pytest.raises(ValueError, match=r"^quantization_config ignore list: model.layers.0.self_attn.q_proj kept .* "
                                         r"fused into model.layers.0.self_attn.qkv_proj; expected all of them or none$"):
        Engine(str(tmp_path), **CPU)


def test_online_fp8_of_a_bf16_checkpoint(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path)
    engine, out = engine_greedy(tmp_path, quantization="fp8")
    layers = quantized_layers(engine)
    assert len(layers) == 8 and all(m.scheme.online for m in layers.values())
    down = engine.runner.model.model.layers[0].mlp.down_proj
    assert down.weight.dtype == torch.float8_e4m3fn and down.weight_scale.shape == (64, 1)
    ref_w = hf_model.model.layers[0].mlp.down_proj.weight
    # per-channel FP8: every weight within half an e4m3 step (2^-4 relative) of the bf16 one
    assert torch.all((down.weight.float() * down.weight_scale - ref_w).abs() <= ref_w.abs().amax(1, keepdim=True) / 16)
    _, plain = engine_greedy(tmp_path)  # auto: a checkpoint without quantization_config stays unquantized
    assert len(out.token_ids) == STEPS and plain.logprobs != out.logprobs


# -- selection ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def registry():
    return load_plugins().registry


def req(fmt, **kw):
    return QuantRequirements(platform="cpu", dtype="float32", checkpoint_format=fmt, **kw)


def test_auto_follows_the_checkpoint(registry):
    assert select_quant_method(registry, "auto", req(None)) is None
    for fmt in ("compressed-tensors", "fp8"):
        choice = select_quant_method(registry, "auto", req(fmt))
        assert choice.spec.name == "fp8" and choice.plugin == "quant_fp8"
    assert select_quant_method(registry, "none", req(None)) is None
    assert select_quant_method(registry, "fp8", req(None)).spec.name == "fp8"  # online


@pytest.mark.parametrize("name, fmt, kw, message", [
    ("int4", "fp8", {}, r"^--quantization: unknown backend 'int4'; registered: fp8 \(plugin 'quant_fp8'\), or 'auto'"),
    ("fp8", "awq", {}, r"^--quantization fp8 \(plugin 'quant_fp8'\) cannot run here: cannot load quant_method 'awq' "
                       r"checkpoints \(loads: compressed-tensors, fp8, fbgemm_fp8, modelopt\)\. Usable here: none$"),
    ("auto", "awq", {}, r"^--quantization auto: no registered quantization method loads quant_method 'awq' checkpoints; "
                        r"registered: fp8 \(plugin 'quant_fp8'\)"),
    ("none", "fp8", {}, r"^--quantization none: the checkpoint is quantized .*expected auto or one of: fp8$"),
])
def test_refusals_are_one_line(registry, name, fmt, kw, message):
    with pytest.raises(SelectionError, match=message) as err:
        select_quant_method(registry, name, req(fmt, **kw))
    assert "\n" not in str(err.value)


def test_lora_is_accepted_over_fp8(registry):
    """LoRA adapters run over an FP8 base (tests/lora/test_lora_fp8_base.py), online or from a checkpoint."""
    for fmt in (None, "compressed-tensors", "fp8"):
        choice = select_quant_method(registry, "fp8", req(fmt, lora=True))
        assert choice.spec.name == "fp8" and choice.spec.supports_lora


def test_a_bad_quantization_config_is_one_line_at_startup(hf_model, tmp_path):
    write_fp8_checkpoint(hf_model, tmp_path, "channel")
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 4
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match=r"quantization_config.config_groups.group_0.weights: num_bits 4, type 'float': "
                                        r"quant_fp8 loads 8-bit float only") as err:
        Engine(str(tmp_path), **CPU)
    assert "\n" not in str(err.value)


def test_a_missing_scale_names_the_parameter(hf_model, tmp_path):
    from safetensors.torch import load_file, save_file

    write_fp8_checkpoint(hf_model, tmp_path, "block")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight_scale_inv"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"no weights for model.layers.1.mlp.down_proj.weight_scale_inv$"):
        Engine(str(tmp_path), **CPU)


# -- tensor parallelism --------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["channel", "tensor", "block"])
def test_tp2_loads_sharded_scales_and_equals_tp1(fmt, hf_model, tmp_path):
    write_fp8_checkpoint(hf_model, tmp_path, fmt)
    _, tp1 = engine_greedy(tmp_path)
    _, tp2 = engine_greedy(tmp_path, tp_size=2)
    assert tp2.error is None and tp2.token_ids == tp1.token_ids
    # NOTE: dynamic per-token scales of a row-parallel layer (o_proj, down_proj) come from each rank's
    # slice of the input, as in vLLM: not the one-rank scale, so those logprobs differ by FP8 rounding.
    # Static per-tensor scales and 1 x bk groups (whole blocks on each rank) give the one-rank numbers.
    tol = 0.15 if fmt == "channel" else 1e-4
    torch.testing.assert_close(torch.tensor(tp2.logprobs), torch.tensor(tp1.logprobs), rtol=tol, atol=tol)


@pytest.mark.parametrize("block, refused", [([16, 16], True), ([128, 16], True), ([16, 32], False), ([128, 128], False)])
def test_blocks_narrower_than_the_cuda_kernels_k_step_are_refused_on_cuda(block, refused):
    """Triton's 8-bit dots on CUDA take K >= 32: a block of fewer columns is refused in one line at
    startup (the CPU path dequantizes and loads any block)."""
    from backplane.contracts import QuantContext
    from backplane.plugins.quant_fp8.config import make_config

    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": block}
    assert make_config(QuantContext(qc, torch.bfloat16, torch.device("cpu"))).scheme.block == tuple(block)
    if not refused:
        assert make_config(QuantContext(qc, torch.bfloat16, torch.device("cuda"))).scheme.block == tuple(block)
        return
    with pytest.raises(ValueError) as err:
        make_config(QuantContext(qc, torch.bfloat16, torch.device("cuda")))
    assert "\n" not in str(err.value) and "at least 32 columns" in str(err.value) and str(block) in str(err.value)


# -- online block-wise FP8 (--fp8.online-block) ---------------------------------------------------------

ONLINE_BLOCK = {"fp8": {"online_block": "16x16"}}  # fp8_checkpoints.BLOCK


def test_online_blocks_equal_the_block_checkpoint_of_the_same_weights(hf_model, tmp_path):
    """A bf16 checkpoint quantized online to 16 x 16 blocks is the block-wise checkpoint written from
    the same weights: the same FP8 bytes and scales, so the same tokens and logprobs, exactly (both
    quantize activations per 1 x 16 group). Channel scales or another block size would differ."""
    hf_model.save_pretrained(tmp_path / "bf16")
    write_fp8_checkpoint(hf_model, tmp_path / "block", "block")
    online, out = engine_greedy(tmp_path / "bf16", quantization="fp8", plugin_options=ONLINE_BLOCK)
    stored, want = engine_greedy(tmp_path / "block")
    layers = quantized_layers(online)
    assert len(layers) == 8 and all(m.scheme.online and m.scheme.block == (16, 16) for m in layers.values())
    for name in ("self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        got = online.runner.model.get_submodule(f"model.layers.1.{name}")
        ref = stored.runner.model.get_submodule(f"model.layers.1.{name}")
        assert torch.equal(got.weight.view(torch.uint8), ref.weight.view(torch.uint8))
        torch.testing.assert_close(got.weight_scale, ref.weight_scale_inv, rtol=0, atol=0)
    assert out.token_ids == want.token_ids and out.logprobs == want.logprobs
    _, wider = engine_greedy(tmp_path / "bf16", quantization="fp8", plugin_options={"fp8": {"online_block": "32x32"}})
    assert wider.logprobs != want.logprobs  # the comparison sees the block size


@pytest.mark.parametrize("kw, message", [
    (dict(quantization="auto"), r"^--fp8.online-block 16x16: applies to --quantization fp8 .*; got --quantization auto"),
    (dict(quantization="fp8", plugin_options={"fp8": {"online_block": "48x16"}}),
     r"^--fp8.online-block 48x16: layer model.layers.0.self_attn.qkv_proj has parts of \[64, 32, 32\] rows and 64 "
     r"columns \(per rank\); expected every part a multiple of 48 and the columns of 16$"),
    (dict(quantization="fp8", plugin_options={"fp8": {"online_block": "16"}}), r"--fp8.online-block '16': expected "
     r"ROWSxCOLUMNS of a weight block, two integers > 0 \(e.g. 128x128\)"),
])
def test_online_block_refusals_are_one_line(hf_model, tmp_path, kw, message):
    hf_model.save_pretrained(tmp_path)
    with pytest.raises(Exception, match=message) as err:
        Engine(str(tmp_path), **CPU, **{"plugin_options": ONLINE_BLOCK, **kw})
    assert "\n" not in str(err.value)


def test_online_block_over_an_fp8_checkpoint_is_refused(hf_model, tmp_path):
    write_fp8_checkpoint(hf_model, tmp_path, "channel")
    with pytest.raises(Exception, match=r"^--fp8.online-block 16x16: quantizes a bf16 checkpoint online, but this "
                                        r"checkpoint is already quantized .*'compressed-tensors'\)") as err:
        Engine(str(tmp_path), **CPU, quantization="fp8", plugin_options=ONLINE_BLOCK)
    assert "\n" not in str(err.value)


def test_online_blocks_of_cuda_are_at_least_32_columns():
    from backplane.contracts import QuantContext
    from backplane.plugins.quant_fp8.config import make_config
    from backplane.plugins.quant_fp8.options import Fp8Options

    ctx = QuantContext(None, torch.bfloat16, torch.device("cuda"), options=Fp8Options(online_block="128x128"))
    assert make_config(ctx).scheme.block == (128, 128) and make_config(ctx).scheme.online
    with pytest.raises(ValueError, match="at least 32 columns"):
        make_config(QuantContext(None, torch.bfloat16, torch.device("cuda"), options=Fp8Options(online_block="128x16")))
