"""Phi-3 beyond the suite: long factors end to end, tensor parallelism 2 on CPU, fused weights sharded
per rank, bad checkpoints, the checkpoint layout, and the import boundary."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from backplane import Engine, SamplingParams
from backplane.layers.parallel import ParallelContext
from backplane.models import ModelContext
from backplane.plugins.model_phi3.model import Phi3ForCausalLM, phi3_checkpoint_shapes
from backplane.testing.boundary import check_plugin_imports
from backplane.testing.model_conformance import ENGINE_ARGS, assert_matches, random_prompts, save_reference

ROOT = Path(__file__).resolve().parents[3]
PROMPT_FREE = dict(pad_token_id=None, bos_token_id=1, eos_token_id=2)
# original context 16 of 512: every sequence below is longer, so transformers takes the long factors
# (and the attention factor sqrt(1 + ln 32 / ln 16)), as backplane does for a context past the original.
LONG_ROPE = dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.5, 3.0, 6.0],
                               "long_factor": [2.0, 4.0, 8.0, 16.0]},
                 partial_rotary_factor=0.5, original_max_position_embeddings=16, **PROMPT_FREE)


def _config(**overrides) -> transformers.Phi3Config:
    shape = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, vocab_size=300,
                 num_hidden_layers=1, max_position_embeddings=512)
    return transformers.Phi3Config(**{**shape, **PROMPT_FREE, **overrides})


def test_long_factors_match_transformers(tmp_path):
    reference = save_reference("Phi3ForCausalLM", transformers.Phi3Config, 4, tmp_path, LONG_ROPE)
    reference.steps = 4
    prompts = random_prompts(4, (24, 17), reference.model.config.vocab_size)
    engine = Engine(str(tmp_path), **ENGINE_ARGS)
    params = SamplingParams(max_new_tokens=reference.steps, temperature=0.0, ignore_eos=True)
    for n, (prompt, out) in enumerate(zip(prompts, engine.generate(input_ids=prompts, sampling_params=params))):
        assert out.error is None, out.error
        assert_matches(f"longrope past the original context, request {n}", prompt, out, reference)


@pytest.mark.parametrize("num_kv_heads", [1, 4])  # replicated over the 2 ranks; split 2 and 2
def test_tp2_matches_transformers(tmp_path, num_kv_heads):
    """Two CPU ranks (gloo) serve the fused checkpoint: each loads its own heads and gate/up rows."""
    reference = save_reference("Phi3ForCausalLM", transformers.Phi3Config, 5, tmp_path,
                               {**LONG_ROPE, "num_key_value_heads": num_kv_heads, "num_hidden_layers": 2})
    reference.steps = 4
    prompts = random_prompts(5, (20, 33), reference.model.config.vocab_size)
    engine = Engine(str(tmp_path), tp_size=2, max_total_tokens=512, **ENGINE_ARGS)
    try:
        params = SamplingParams(max_new_tokens=reference.steps, temperature=0.0, ignore_eos=True)
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        assert engine.runner.model.num_heads == 2  # this rank's share of 4
    finally:
        engine.shutdown()
    for n, (prompt, out) in enumerate(zip(prompts, outs)):
        assert out.error is None, out.error
        assert_matches(f"tp 2, {num_kv_heads} KV heads, request {n}", prompt, out, reference)


def _rank_model(config, rank: int, tp_size: int) -> tuple[Phi3ForCausalLM, dict[str, torch.Tensor]]:
    model = Phi3ForCausalLM(config, ModelContext(parallel=ParallelContext(tp_rank=rank, tp_size=tp_size)))
    state = transformers.Phi3ForCausalLM(config).state_dict()
    model.load_weights(state.items())
    return model, state


@pytest.mark.parametrize("num_kv_heads", [2, 1])  # one KV head per rank; one KV head replicated
@pytest.mark.parametrize("rank", [0, 1])
def test_fused_weights_shard_per_rank(rank, num_kv_heads):
    config = _config(num_key_value_heads=num_kv_heads)
    model, state = _rank_model(config, rank, 2)
    qkv = state["model.layers.0.self_attn.qkv_proj.weight"]  # [(4 + 2 * kv) * 16, 64]
    q, k, v = qkv.split([64, 16 * num_kv_heads, 16 * num_kv_heads])
    kv_rank = rank if num_kv_heads == 2 else 0
    want = torch.cat([q[32 * rank: 32 * rank + 32], k[16 * kv_rank: 16 * kv_rank + 16],
                      v[16 * kv_rank: 16 * kv_rank + 16]])
    torch.testing.assert_close(model.model.layers[0].self_attn.qkv_proj.weight, want, rtol=0, atol=0)
    gate, up = state["model.layers.0.mlp.gate_up_proj.weight"].chunk(2)  # [96, 64] each
    want = torch.cat([gate[48 * rank: 48 * rank + 48], up[48 * rank: 48 * rank + 48]])
    torch.testing.assert_close(model.model.layers[0].mlp.gate_up_proj.weight, want, rtol=0, atol=0)


@pytest.mark.parametrize("name, rows", [("self_attn.qkv_proj", 100), ("mlp.gate_up_proj", 95)])
def test_fused_tensor_of_the_wrong_size_is_named(name, rows):
    config = _config()
    model = Phi3ForCausalLM(config, ModelContext())
    state = transformers.Phi3ForCausalLM(config).state_dict()
    state[f"model.layers.0.{name}.weight"] = torch.zeros(rows, 64)
    with pytest.raises(ValueError, match=rf"'model\.layers\.0\.{name}\.weight': expected \d+ rows .*got shape \({rows}, 64\)"):
        model.load_weights(state.items())


@pytest.mark.parametrize("tied", [False, True])
def test_checkpoint_shapes_are_transformers(tied):
    config = _config(num_hidden_layers=2, num_key_value_heads=2, tie_word_embeddings=tied)
    state = transformers.Phi3ForCausalLM(config).state_dict()
    expected = {name: tuple(t.shape) for name, t in state.items() if not (tied and name == "lm_head.weight")}
    assert dict(phi3_checkpoint_shapes(config)) == expected


def test_plugin_imports_only_public_modules():
    assert check_plugin_imports(ROOT / "plugins" / "model_phi3", "backplane.plugins.model_phi3") == []
