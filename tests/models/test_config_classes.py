"""Model configs and weights that used to run wrongly or waste memory (issue 42): a rope factor of
0, negative or a string; keys transformers ignores for an architecture (followed here too, checked
against transformers); tie_word_embeddings with a different lm_head; fp32 weights beyond fp16's
range loaded as fp16; one rotary cache shared by every layer; the tensor-parallel head check and
the memory estimate made before anything is built."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch
from helpers_models import hf_greedy, make_hf_model, tiny_hf_config
from safetensors.torch import load_file, save_file

from backplane import Engine, SamplingParams
from backplane.models.config_check import check_model_memory, check_tensor_parallel
from backplane.models.loader import load_hf_config

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
PROMPT = [5, 17, 33, 2, 9, 41, 7, 250, 3, 88, 19]


def saved_llama(path, **overrides):
    make_hf_model(tiny_hf_config("LlamaForCausalLM", **overrides), seed=3).save_pretrained(path)
    return path


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def one_line(err) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("factor", [0, -2.0, "4", None, True])
def test_bad_rope_factor_is_one_line(tmp_path, factor):
    path = saved_llama(tmp_path / "m")
    edit_config(path, rope_scaling={"rope_type": "linear", "factor": factor})
    with pytest.raises(ValueError) as err:
        load_hf_config(path)
    assert f"field 'rope_scaling.factor' = {factor!r}: expected a finite number > 0" in one_line(err)


def test_keys_transformers_ignores_for_llama_are_ignored_here(tmp_path, caplog):
    path = saved_llama(tmp_path / "m")
    edit_config(path, sliding_window=2, use_sliding_window=True, final_logit_softcapping=0.05)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    expected, _ = hf_greedy(hf, PROMPT, GREEDY.max_new_tokens)
    with caplog.at_level(logging.WARNING, logger="backplane.models.loader"):
        engine = Engine(str(path), device="cpu", dtype="float32", max_total_tokens=512)
    out = engine.generate(input_ids=[PROMPT], sampling_params=GREEDY)[0]
    assert PROMPT + out.token_ids == expected
    warning = [r.getMessage() for r in caplog.records if "ignores" in r.getMessage() and "in transformers" in r.getMessage()]
    assert len(warning) == 1 and "LlamaForCausalLM ignores sliding_window=2" in warning[0]
    assert "final_logit_softcapping=0.05" in warning[0] and "\n" not in warning[0]


def test_mistral_keeps_its_sliding_window(tmp_path):
    make_hf_model(tiny_hf_config("MistralForCausalLM"), seed=4).save_pretrained(tmp_path)
    assert load_hf_config(tmp_path).sliding_window == 8


def test_tied_embeddings_with_a_different_lm_head_are_refused(tmp_path):
    path = saved_llama(tmp_path / "m")  # tie_word_embeddings false: lm_head.weight is its own tensor
    edit_config(path, tie_word_embeddings=True)
    with pytest.raises(ValueError) as err:
        Engine(str(path), device="cpu", dtype="float32", max_total_tokens=256)
    assert "'lm_head.weight' differs from 'model.embed_tokens.weight'" in one_line(err)


def test_tied_embeddings_with_an_equal_lm_head_load(tmp_path):
    path = saved_llama(tmp_path / "m")
    edit_config(path, tie_word_embeddings=True)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(path / "model.safetensors"))
    Engine(str(path), device="cpu", dtype="float32", max_total_tokens=256)


def test_fp32_weight_beyond_fp16_range_is_refused_as_fp16(tmp_path):
    path = saved_llama(tmp_path / "m")
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name][0, 0] = 1e6
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError) as err:
        Engine(str(path), device="cpu", dtype="float16", max_total_tokens=256)
    assert f"checkpoint tensor {name!r}: holds 1e+06, beyond float16's largest value" in one_line(err)
    Engine(str(path), device="cpu", dtype="bfloat16", max_total_tokens=256)  # in range there


def test_every_layer_shares_one_rotary_cache():
    engine = Engine("tiny-llama", device="cpu", dtype="float32", max_total_tokens=256)
    layers = engine.runner.model.model.layers
    caches = {layer.self_attn.rotary_emb.cos_sin_cache.data_ptr() for layer in layers}
    assert len(layers) > 1 and len(caches) == 1
    engine.runner.model.half()  # a dtype change keeps the fp32 cache, still shared
    caches = {layer.self_attn.rotary_emb.cos_sin_cache for layer in layers}
    assert len({c.data_ptr() for c in caches}) == 1 and next(iter(caches)).dtype == torch.float32


def shape(**overrides):
    base = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=2, vocab_size=300, max_position_embeddings=128, head_dim=16,
                tie_word_embeddings=False)
    return SimpleNamespace(**{**base, **overrides})


@pytest.mark.parametrize("tp, field", [(8, "num_attention_heads"), (3, "num_attention_heads"),
                                       (4, "num_key_value_heads")])
def test_tp_size_the_heads_do_not_divide_is_refused(tp, field):
    config = shape(num_key_value_heads=3, num_attention_heads=12) if field == "num_key_value_heads" else shape()
    with pytest.raises(ValueError) as err:
        check_tensor_parallel(config, tp)
    assert one_line(err).startswith(f"--tp-size {tp}: the model's {field}")


def test_tp_size_that_divides_or_replicates_kv_heads_passes():
    check_tensor_parallel(shape(), 2)
    check_tensor_parallel(shape(), 4)  # 2 KV heads replicated over 4 ranks


@pytest.mark.parametrize("field, value", [("vocab_size", 10**10), ("max_position_embeddings", 10**11)])
def test_memory_estimate_names_the_costly_field(field, value):
    with pytest.raises(ValueError) as err:
        check_model_memory(shape(**{field: value}), dtype_bytes=2, free_bytes=2**34, device="cpu")
    assert one_line(err).startswith(f"model config: {field} {value} makes the model need about")
    check_model_memory(shape(), dtype_bytes=2, free_bytes=2**34, device="cpu")


def test_memory_estimate_counts_every_expert_of_a_moe_model():
    """Qwen3-30B-A3B's shapes: 57 GiB in bf16, nearly all of it experts (a dense estimate from
    intermediate_size alone would say a few GiB)."""
    from transformers import Qwen3MoeConfig

    from backplane.models.config_check import model_memory_terms

    config = Qwen3MoeConfig(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                            head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                            vocab_size=151936, max_position_embeddings=40960)
    assert 56 * 2**30 < sum(model_memory_terms(config, 2).values()) < 58 * 2**30
    assert 27 * 2**30 < sum(model_memory_terms(config, 2, tp_size=2).values()) < 30 * 2**30
    with pytest.raises(ValueError) as err:
        check_model_memory(config, dtype_bytes=2, free_bytes=40 * 2**30, device="cuda")
    assert "128 makes the model need about 56.9 GiB" in one_line(err)
