"""Loader errors, presets, deterministic dummy weights, the byte tokenizer and model registration."""

from __future__ import annotations

import json

import pytest
import torch
from helpers_models import BatchBuilder, make_hf_model, tiny_hf_config

from backplane.attention.torch_native import TorchNativeAttnBackend
from backplane.models import builtin as models_builtin
from backplane.models.base import ModelContext
from backplane.models.byte_tokenizer import ByteTokenizer
from backplane.models.llama import LlamaForCausalLM, build_model
from backplane.models.loader import get_model_spec, iterate_safetensors, load_hf_config
from backplane.models.presets import PRESETS, dummy_weights, get_preset, init_dummy_weights
from backplane.plugin.registry import Registry


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_hf_model(tiny_hf_config("LlamaForCausalLM"), seed=0).save_pretrained(path)
    return path


def test_missing_directory(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=f"model path '{missing}'.*does not exist"):
        load_hf_config(missing)


def test_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"model path '{tmp_path}': expected a config.json"):
        load_hf_config(tmp_path)


def test_directory_without_weights(tmp_path, saved_llama):
    (tmp_path / "config.json").write_text((saved_llama / "config.json").read_text())
    assert load_hf_config(tmp_path).architectures == ["LlamaForCausalLM"]
    with pytest.raises(FileNotFoundError, match=f"model path '{tmp_path}': expected model.safetensors"):
        iterate_safetensors(tmp_path)


def test_missing_shard_is_named(tmp_path):
    index = {"metadata": {}, "weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                                            "b.weight": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors' named in"):
        iterate_safetensors(tmp_path)


def test_corrupt_file_is_named(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x07not a safetensors file at all" * 3)
    with pytest.raises(ValueError, match="model.safetensors' is corrupt or unreadable"):
        list(iterate_safetensors(tmp_path))


def test_iterate_safetensors_yields_every_tensor(saved_llama):
    hf_state = make_hf_model(tiny_hf_config("LlamaForCausalLM"), seed=0).state_dict()
    loaded = dict(iterate_safetensors(saved_llama))
    assert set(loaded) == set(hf_state)
    assert all(torch.equal(loaded[name], hf_state[name]) for name in loaded)


def registered_models():
    registry = Registry()
    models_builtin.backplane_register_models(register=registry.callback("model", "builtin", None))
    return registry.specs("model")


def test_builtin_models_registered():
    assert set(registered_models()) == {
        "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}


def test_unregistered_architecture_lists_registered():
    config = tiny_hf_config("LlamaForCausalLM", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not registered; registered: LlamaForCausalLM, "
                                         "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        get_model_spec(registered_models(), config)


def test_unexpected_and_missing_weights_are_named():
    config = get_preset("tiny-llama")
    model = build_model(LlamaForCausalLM, config, ModelContext())
    with pytest.raises(ValueError, match="'model.layers.0.mlp.fc9.weight' has no parameter"):
        model.load_weights([("model.layers.0.mlp.fc9.weight", torch.ones(1))])
    all_but_norm = [(n, w) for n, w in dummy_weights(model.checkpoint_shapes(), 0) if n != "model.norm.weight"]
    with pytest.raises(ValueError, match="has no weights for model.norm.weight$"):
        model.load_weights(all_but_norm)
    vocab, hidden = config.vocab_size, config.hidden_size
    with pytest.raises(ValueError, match=rf"expected shape \({vocab}, {hidden}\), got \({vocab - 1}, {hidden}\)"):
        model.load_weights([("lm_head.weight", torch.ones(vocab - 1, hidden))], strict=False)


def test_unknown_preset_lists_presets():
    with pytest.raises(ValueError, match="unknown model preset 'llama-9'; expected one of: tiny-llama, llama-3.2-1b"):
        get_preset("llama-9")


def test_presets_have_real_shapes():
    assert set(PRESETS) >= {"tiny-llama", "llama-3.2-1b", "llama-3.1-8b", "qwen2.5-0.5b", "qwen3-0.6b"}
    tiny = get_preset("tiny-llama")
    assert tiny.vocab_size >= ByteTokenizer.vocab_size and tiny.num_hidden_layers == 2
    big = get_preset("llama-3.1-8b")
    assert (big.hidden_size, big.num_hidden_layers, big.num_key_value_heads) == (4096, 32, 8)
    assert get_preset("llama-3.2-1b").tie_word_embeddings
    assert get_preset("qwen3-0.6b").architectures == ["Qwen3ForCausalLM"]


def dummy_model(seed: int, dtype=torch.float32, tie: bool = False):
    config = get_preset("tiny-llama")
    config.tie_word_embeddings = tie
    model = build_model(LlamaForCausalLM, config, ModelContext(dtype=dtype))
    init_dummy_weights(model, seed)
    return model


def test_dummy_weights_deterministic_from_seed():
    a, b, c = dummy_model(0).state_dict(), dummy_model(0).state_dict(), dummy_model(1).state_dict()
    assert all(torch.equal(a[name], b[name]) for name in a)
    matrices = [name for name in a if a[name].dim() == 2]
    assert all(not torch.equal(a[name], c[name]) for name in matrices)
    assert torch.equal(a["model.norm.weight"], torch.ones(get_preset("tiny-llama").hidden_size))
    assert 0.015 < float(a["model.layers.0.mlp.gate_up_proj.weight"].std()) < 0.025


def test_dummy_weights_independent_of_dtype():
    fp32, bf16 = dummy_model(5).state_dict(), dummy_model(5, dtype=torch.bfloat16).state_dict()
    assert all(torch.equal(fp32[name].to(torch.bfloat16), bf16[name]) for name in fp32)


def test_tiny_preset_runs_with_byte_tokenizer():
    model = dummy_model(0, tie=True)
    model.ctx.attn_backend = TorchNativeAttnBackend(None)
    tok = ByteTokenizer()
    prompts = [tok.encode("hello"), tok.encode("héllo wörld!")]
    builder = BatchBuilder.for_model(model)
    with torch.no_grad():
        logits = model(builder.extend([builder.add_request() for _ in prompts], prompts)).logits
    assert logits.shape == (2, model.vocab_size) and torch.isfinite(logits).all()


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "Grüße, 世界! \n\t🙂"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and all(3 <= i <= 258 for i in ids[1:])
    assert tok.decode(ids) == text
    assert tok.encode("a", add_special_tokens=False) == [ord("a") + 3]
    assert tok.decode([1, 3 + ord("o"), 3 + ord("k"), 2, 400]) == "ok"
    assert tok.decode([1, 3 + ord("o"), 2], skip_special_tokens=False) == "<s>o</s>"
    assert tok.decode([3 + 0xC3]) == "\ufffd"  # a lone UTF-8 lead byte


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tensor_parallel_shards_recombine(tp_size):
    """Each rank loads its slice of the full tensors; the slices rebuild the tp=1 weights."""
    from backplane.layers.parallel import ParallelContext

    config = get_preset("tiny-llama")
    assert config.num_key_value_heads == 2  # at tp 4 each KV head serves two ranks
    full = dummy_model(9).state_dict()
    ranks = []
    for rank in range(tp_size):
        ctx = ModelContext(parallel=ParallelContext(tp_rank=rank, tp_size=tp_size))
        model = build_model(LlamaForCausalLM, config, ctx)
        init_dummy_weights(model, 9)
        ranks.append(model.state_dict())
    assert model.num_kv_heads == max(1, 2 // tp_size)
    p, head_dim = "model.layers.1.", model.head_dim
    q_size, kv_size = config.num_attention_heads * head_dim, 2 * head_dim
    q, k, v = full[p + "self_attn.qkv_proj.weight"].split([q_size, kv_size, kv_size])
    qs = [r[p + "self_attn.qkv_proj.weight"] for r in ranks]
    q_local, kv_local = q_size // tp_size, head_dim * model.num_kv_heads
    assert torch.equal(torch.cat([w[:q_local] for w in qs]), q)
    kv_group = max(1, tp_size // 2)  # ranks sharing one KV head
    ks = [w[q_local : q_local + kv_local] for w in qs][::kv_group]
    vs = [w[q_local + kv_local :] for w in qs][::kv_group]
    assert torch.equal(torch.cat(ks), k) and torch.equal(torch.cat(vs), v)
    assert torch.equal(torch.cat([r[p + "self_attn.o_proj.weight"] for r in ranks], dim=1), full[p + "self_attn.o_proj.weight"])
    gate, up = full[p + "mlp.gate_up_proj.weight"].chunk(2)
    gate_ups = [r[p + "mlp.gate_up_proj.weight"].chunk(2) for r in ranks]
    assert torch.equal(torch.cat([g for g, _ in gate_ups]), gate) and torch.equal(torch.cat([u for _, u in gate_ups]), up)
    assert torch.equal(torch.cat([r["model.embed_tokens.weight"] for r in ranks]), full["model.embed_tokens.weight"])
