"""FP8 mixture-of-experts checkpoints on CPU: a tiny random Qwen3-MoE saved block-wise FP8 as
Qwen3-30B-A3B-FP8 is (experts and attention FP8, `weight_scale_inv` 1 x bk activation groups; the
router in high precision) and per-channel FP8 (compressed-tensors) loads through the engine with the
torch_native MoE backend and gives transformers' greedy tokens and logprobs with the dequantized
weights and the same activation quantization; a planted scale error fails that comparison; online
`--quantization fp8` quantizes the experts per channel (or, with --fp8.online-block, per block, equal
to the block checkpoint); a MoE backend that does not declare fp8 is
refused in one line."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

from backplane import Engine, MoeBackendSpec, SamplingParams
from backplane.plugin.manager import load_plugins
from backplane.plugin.selection import MoeRequirements, SelectionError, select_moe_backend
from backplane.plugins.quant_fp8 import quantize as fq

sys.path.insert(0, str(Path(__file__).parent))
from fp8_checkpoints import BLOCK, quantization_config, quantized_state  # noqa: E402
from helpers_models import hf_greedy  # noqa: E402
from helpers_plugins import make_plugin  # noqa: E402

CPU = dict(device="cpu", dtype="float32", max_total_tokens=512, moe_backend="torch_native")
PROMPT = [5, 17, 33, 2, 9, 120, 44]
STEPS = 5
GREEDY = SamplingParams(max_new_tokens=STEPS, temperature=0.0, ignore_eos=True)
# hidden 64 and expert intermediate 32: both multiples of the 16 x 16 weight blocks
CONFIG = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              vocab_size=300, num_hidden_layers=2, max_position_embeddings=512, num_experts=6, num_experts_per_tok=3,
              moe_intermediate_size=32, norm_topk_prob=True, tie_word_embeddings=False,
              initializer_range=0.1)  # weights large enough that the logits are far from uniform


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A random fp32 Qwen3-MoE saved as transformers saves it (one tensor per expert and projection)."""
    path = tmp_path_factory.mktemp("qwen3moe")
    config = transformers.Qwen3MoeConfig(**CONFIG)
    config.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(4)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    model.save_pretrained(path)
    return path, load_file(str(path / "model.safetensors"))


def write_checkpoint(src: Path, state: dict[str, torch.Tensor], path: Path, fmt: str) -> dict[str, torch.Tensor]:
    """`state` in FP8 format `fmt` ("block" or "channel") under `path`: every q/k/v/o projection and
    every expert's gate/up/down; returns the dequantized fp32 state (what the reference loads)."""
    tensors, dequant = quantized_state(state, fmt)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt)
    (path / "config.json").write_text(json.dumps(config))
    return {**state, **{f"{m}.weight": w for m, w in dequant.items()}}


def _fake_quant(fmt: str, x: torch.Tensor) -> torch.Tensor:
    """x as the FP8 GEMM sees it: quantized per 1 x bk group ("block") or per token, dequantized."""
    x2 = x.reshape(-1, x.shape[-1])
    if fmt == "block":
        y = fq.dequantize_groups(*fq.quantize_per_group(x2, BLOCK[1]))
    else:
        q, s = fq.quantize_per_token(x2)
        y = q.float() * s
    return y.reshape(x.shape).to(x.dtype)


def _experts_forward(fmt: str):
    """transformers' expert loop with each GEMM's input quantized as the engine quantizes it."""
    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            pos, tokens = torch.where(top_k_index.T == e)
            if tokens.numel() == 0:
                continue
            gate, up = F.linear(_fake_quant(fmt, hidden_states[tokens]), self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(_fake_quant(fmt, F.silu(gate) * up), self.down_proj[e])
            out.index_add_(0, tokens, y * top_k_weights[tokens, pos, None])
        return out
    return forward


def reference(src: Path, dequant: dict[str, torch.Tensor], tmp: Path, fmt: str):
    """transformers' fp32 model with the dequantized weights, every FP8 GEMM's input quantized."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text((src / "config.json").read_text())
    save_file(dequant, str(tmp / "model.safetensors"))
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="eager", dtype=torch.float32)
    for name, module in model.named_modules():
        if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")):
            module.register_forward_pre_hook(lambda _m, args: (_fake_quant(fmt, args[0]),))
        if name.endswith("mlp.experts"):
            module.forward = types.MethodType(_experts_forward(fmt), module)
    return model.eval()


def engine_greedy(path: Path, **kwargs):
    engine = Engine(str(path), **{**CPU, **kwargs})
    try:
        return engine, engine.generate(input_ids=[PROMPT], sampling_params=GREEDY)[0]
    finally:
        engine.shutdown()


def check_against(ref_model, out, tol: float = 1e-4) -> None:
    """Greedy tokens equal the reference's up to a near-tie of it (then the comparison stops there),
    and the logprobs of the tokens both chose agree within `tol`."""
    ids, logits = hf_greedy(ref_model, PROMPT, STEPS)
    want = ids[len(PROMPT):]
    same = next((j for j, (a, b) in enumerate(zip(want, out.token_ids)) if a != b), STEPS)
    if same < STEPS:
        row = logits[len(PROMPT) - 1 + same]
        margin = float((row[want[same]] - row[out.token_ids[same]]).abs() / row.std())
        assert margin < 0.05, f"token {same}: {out.token_ids[same]} where the reference clearly prefers {want[same]}"
    expected = torch.log_softmax(logits[len(PROMPT) - 1:-1], -1)[:same].gather(1, torch.tensor(want[:same])[:, None])
    torch.testing.assert_close(torch.tensor(out.logprobs[:same]), expected[:, 0], rtol=tol, atol=tol)


@pytest.mark.parametrize("fmt", ["block", "channel"])
def test_fp8_moe_checkpoint_matches_the_dequantized_reference(fmt, saved, tmp_path):
    src, state = saved
    dequant = write_checkpoint(src, state, tmp_path / "fp8", fmt)
    engine, out = engine_greedy(tmp_path / "fp8")
    assert out.error is None
    check_against(reference(src, dequant, tmp_path / "ref", fmt), out)
    block = engine.runner.model.model.layers[0].mlp
    scale = "weight_scale_inv" if fmt == "block" else "weight_scale"
    assert block.w13_weight.dtype == torch.float8_e4m3fn and block.moe_info.quant.scales == fmt
    want = (6, 2 * 32 // 16, 64 // 16) if fmt == "block" else (6, 2 * 32)
    assert tuple(getattr(block, f"w13_{scale}").shape) == want
    assert block.gate.weight.dtype == torch.float32  # the router stays in the model dtype
    assert engine.runner.model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn


def test_a_planted_expert_scale_error_fails_the_comparison(saved, tmp_path):
    src, state = saved
    dequant = write_checkpoint(src, state, tmp_path / "fp8", "block")
    tensors = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    for e in range(CONFIG["num_experts"]):  # one block row of every expert's down projection, 25% off
        tensors[f"model.layers.0.mlp.experts.{e}.down_proj.weight_scale_inv"][1] *= 1.25
    save_file(tensors, str(tmp_path / "fp8" / "model.safetensors"))
    _, out = engine_greedy(tmp_path / "fp8")
    with pytest.raises(AssertionError):
        check_against(reference(src, dequant, tmp_path / "ref", "block"), out)


def test_online_fp8_quantizes_the_experts_per_channel(saved, tmp_path):
    src, state = saved
    engine, out = engine_greedy(src, quantization="fp8")
    assert out.error is None and len(out.token_ids) == STEPS
    block = engine.runner.model.model.layers[1].mlp
    assert block.w2_weight.dtype == torch.float8_e4m3fn and block.w2_weight_scale.shape == (6, 64)
    got = block.w2_weight.float() * block.w2_weight_scale[:, :, None]
    want = torch.stack([state[f"model.layers.1.mlp.experts.{e}.down_proj.weight"] for e in range(6)])
    assert torch.all((got - want).abs() <= want.abs().amax(-1, keepdim=True) / 16)  # e4m3: 3 mantissa bits


def test_online_fp8_blocks_equal_the_block_checkpoint(saved, tmp_path):
    """`--fp8.online-block 16x16` over the fp32 checkpoint stores the experts (and attention) exactly as
    the block-wise checkpoint of the same weights does: the same FP8 bytes and block scales, so the
    same tokens and logprobs."""
    src, state = saved
    write_checkpoint(src, state, tmp_path / "fp8", "block")
    online, out = engine_greedy(src, quantization="fp8", plugin_options={"fp8": {"online_block": "16x16"}})
    stored, want = engine_greedy(tmp_path / "fp8")
    got, ref = online.runner.model.model.layers[1].mlp, stored.runner.model.model.layers[1].mlp
    assert got.moe_info.quant.scales == "block" and got.moe_info.quant.online
    for name in ("w13", "w2"):
        assert torch.equal(getattr(got, f"{name}_weight").view(torch.uint8), getattr(ref, f"{name}_weight").view(torch.uint8))
        assert torch.equal(getattr(got, f"{name}_weight_scale"), getattr(ref, f"{name}_weight_scale_inv"))
    assert out.token_ids == want.token_ids and out.logprobs == want.logprobs


def test_online_blocks_that_do_not_divide_the_experts_are_one_line(saved):
    with pytest.raises(Exception, match=r"MoE layer 0: expert weight blocks \[16, 64\] do not divide the intermediate "
                                        r"size per rank 32") as err:
        Engine(str(saved[0]), **CPU, quantization="fp8", plugin_options={"fp8": {"online_block": "16x64"}})
    assert "\n" not in str(err.value)


def test_a_moe_backend_without_fp8_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv("BACKPLANE_PLUGINS", "")  # the builtins and this one
    bare = MoeBackendSpec(name="plain", factory=lambda ctx: None, description="unquantized only")
    plugin = make_plugin("plain_moe", backplane_register_moe_backends=lambda register: register(bare))
    registry = load_plugins(extra=[plugin]).registry
    req = MoeRequirements(platform="cpu", dtype="float32", num_experts=6, top_k=3, quant="fp8")
    with pytest.raises(SelectionError) as err:
        select_moe_backend(registry, "plain", req)
    message = str(err.value)
    assert "\n" not in message and message.startswith("--moe-backend plain")
    assert "expert weights quantized by 'fp8' not supported" in message and "Usable here: torch_native" in message
    assert select_moe_backend(registry, "torch_native", req).spec.quant_methods == ("fp8",)
