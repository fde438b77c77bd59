"""Broken model, adapter and tokenizer files are refused at load with one line naming the file,
the field and what was expected (docs/reliability.md R55-R61); `--tokenizer-path` is used (R61)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from backplane import Engine, SamplingParams
from backplane.cli import main
from backplane.models.weights import llama_checkpoint_shapes

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
          "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
          "vocab_size": 300, "max_position_embeddings": 128, "tie_word_embeddings": False}
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


def checkpoint(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights of every tensor a checkpoint of `config` holds, with their full shapes."""
    from transformers import LlamaConfig

    gen = torch.Generator().manual_seed(seed)
    shapes = llama_checkpoint_shapes(LlamaConfig(**config), qkv_bias=False, qk_norm=False)
    return {name: 0.1 * torch.randn(shape, generator=gen) for name, shape in shapes}


def write_model(path: Path, config: dict | str, tensors: dict[str, torch.Tensor] | None = None) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    save_file(tensors if tensors is not None else checkpoint(CONFIG), str(path / "model.safetensors"))
    return str(path)


def run_cli(argv: list[str], capsys) -> str:
    """The one stderr line of a `backplane` run that must fail with exit code 2."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("backplane: error: "), err
    return err


def generate(model: str, *extra: str) -> list[str]:
    return ["generate", "--model", model, "--device", "cpu", "--input-ids", "5,6", "--max-new-tokens", "2", *extra]


BAD_CONFIGS = [
    ("string_int", {"hidden_size": "64"}, "field 'hidden_size' = '64': expected an integer >= 1"),
    ("zero_heads", {"num_attention_heads": 0}, "field 'num_attention_heads' = 0: expected an integer >= 1"),
    ("kv_not_divisor", {"num_key_value_heads": 3}, "field 'num_key_value_heads' = 3: expected a divisor of "
                                                   "num_attention_heads 4"),
    ("negative_vocab", {"vocab_size": -5}, "field 'vocab_size' = -5: expected an integer >= 1"),
    ("zero_context", {"max_position_embeddings": 0}, "field 'max_position_embeddings' = 0: expected an integer >= 1"),
    ("architectures_string", {"architectures": "LlamaForCausalLM"},
     "field 'architectures' = 'LlamaForCausalLM': expected a non-empty list of class names"),
    ("hidden_not_multiple", {"hidden_size": 66}, "field 'hidden_size' = 66: expected a multiple of "
                                                 "num_attention_heads 4 (or set head_dim)"),
    ("nan_eps", {"rms_norm_eps": math.nan}, "field 'rms_norm_eps' = nan: expected a finite number > 0"),
    ("bool_layers", {"num_hidden_layers": True}, "field 'num_hidden_layers' = True: expected an integer >= 1"),
]


@pytest.mark.parametrize("case, change, fragment", BAD_CONFIGS, ids=[b[0] for b in BAD_CONFIGS])
def test_bad_config_field_is_named(tmp_path, capsys, case, change, fragment):  # R55
    path = write_model(tmp_path / case, {**CONFIG, **change})
    err = run_cli(generate(path), capsys)
    assert f"model config '{path}/config.json': {fragment}" in err


def test_config_that_is_not_json(tmp_path, capsys):  # R55
    path = write_model(tmp_path / "m", '{"hidden_size": 64,')
    assert "config.json': expected JSON, got a parse error: " in run_cli(generate(path), capsys)
    path = write_model(tmp_path / "list", "[1, 2]")
    assert "config.json': expected a JSON object, got list" in run_cli(generate(path), capsys)


def test_weight_of_wrong_shape_is_named_before_loading(tmp_path, capsys, monkeypatch):  # R56
    tensors = checkpoint(CONFIG)
    tensors[Q_PROJ] = torch.zeros(32, 64)
    path = write_model(tmp_path / "m", CONFIG, tensors)
    read = []
    monkeypatch.setattr("backplane.models.loader._finite", lambda file, name, t: read.append(name) or t)
    err = run_cli(generate(path), capsys)
    assert f"model.safetensors': tensor '{Q_PROJ}' has shape [32, 64]; config.json implies [64, 64]" in err
    assert read == []  # refused from the header: no tensor was read


BAD_INDEXES = [
    ("list_map", {"weight_map": ["model.safetensors"]}, "expected a JSON object with a non-empty 'weight_map' object"),
    ("empty_map", {"weight_map": {}}, "expected a JSON object with a non-empty 'weight_map' object"),
    ("int_shard", {"weight_map": {Q_PROJ: 3}}, f"weight_map['{Q_PROJ}'] = 3: expected the file name of a shard"),
    ("path_shard", {"weight_map": {Q_PROJ: "../x.safetensors"}}, "= '../x.safetensors': expected the file name"),
    ("not_object", [1], "expected a JSON object with a non-empty 'weight_map' object (tensor name -> shard file), got [1]"),
]


@pytest.mark.parametrize("case, index, fragment", BAD_INDEXES, ids=[b[0] for b in BAD_INDEXES])
def test_bad_safetensors_index(tmp_path, capsys, case, index, fragment):  # R57
    path = Path(write_model(tmp_path / case, CONFIG))
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    err = run_cli(generate(str(path)), capsys)
    assert f"safetensors index '{path}/model.safetensors.index.json'" in err and fragment in err


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_model_weights_are_refused(tmp_path, capsys, value):  # R58
    tensors = checkpoint(CONFIG)
    tensors[Q_PROJ][3, 5] = value
    path = write_model(tmp_path / "m", CONFIG, tensors)
    err = run_cli(generate(path), capsys)
    assert f"model.safetensors': tensor '{Q_PROJ}' holds 1 NaN or infinite values; expected finite weights" in err


def test_corrupt_tokenizer_is_named(tmp_path, capsys):  # R59
    path = Path(write_model(tmp_path / "m", CONFIG))
    (path / "tokenizer.json").write_text("{not json")
    err = run_cli(generate(str(path)), capsys)
    assert f"model tokenizer '{path}': expected a tokenizer transformers can load" in err


def _adapter(path: Path, config: dict | str, tensors: dict[str, torch.Tensor] | None = None,
             raw: bytes | None = None) -> str:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if raw is not None:
        (path / "adapter_model.safetensors").write_bytes(raw)
    elif tensors is not None:
        save_file(tensors, str(path / "adapter_model.safetensors"))
    return str(path)


def _lora_tensors(a_value: float | None = None) -> dict[str, torch.Tensor]:
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    a, b = 0.1 * torch.ones(4, 64), 0.1 * torch.ones(64, 4)
    if a_value is not None:
        a[1, 2] = a_value
    return {f"{prefix}.lora_A.weight": a, f"{prefix}.lora_B.weight": b}


LORA_CONFIG = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
BAD_ADAPTERS = [
    ("nan_alpha", '{"r": 4, "lora_alpha": NaN, "target_modules": ["q_proj"]}', _lora_tensors(), None,
     "adapter_config.json): expected lora_alpha to be a finite number, got nan"),
    ("nan_weight", LORA_CONFIG, _lora_tensors(math.nan), None,
     "layer 0 q_proj: lora_A holds NaN or infinite values (in torch.float32); expected finite weights"),
    ("inf_weight", LORA_CONFIG, _lora_tensors(-math.inf), None, "lora_A holds NaN or infinite values"),
    ("truncated", LORA_CONFIG, None, b"\x40\x00\x00\x00\x00\x00\x00\x00{\"a\":",
     "adapter_model.safetensors): expected a safetensors file, it is corrupt or unreadable: "),
    ("config_list", "[4]", _lora_tensors(), None, "adapter_config.json): expected a JSON object, got list"),
    ("string_rank", {**LORA_CONFIG, "r": "4"}, _lora_tensors(), None, "expected r (the rank) to be an integer >= 1, got '4'"),
]


@pytest.mark.parametrize("case, config, tensors, raw, fragment", BAD_ADAPTERS, ids=[b[0] for b in BAD_ADAPTERS])
def test_bad_adapter_is_named(tmp_path, capsys, case, config, tensors, raw, fragment):  # R60
    model = write_model(tmp_path / "model", CONFIG)
    adapter = _adapter(tmp_path / "adapter", config, tensors, raw)
    err = run_cli(generate(model, "--lora-paths", f"a={adapter}"), capsys)
    assert f"LoRA adapter 'a' ({adapter}/" in err and fragment in err


def test_truncated_adapter_after_a_good_one(tmp_path, capsys):  # R60
    """The same adapter with its file cut short: the intact one loads, the cut one is named."""
    model = write_model(tmp_path / "model", CONFIG)
    good = _adapter(tmp_path / "good", LORA_CONFIG, _lora_tensors())
    data = (Path(good) / "adapter_model.safetensors").read_bytes()
    cut = _adapter(tmp_path / "cut", LORA_CONFIG, raw=data[: len(data) - 100])
    assert main(generate(model, "--lora-paths", f"a={good}")) == 0
    capsys.readouterr()
    assert "expected a safetensors file, it is corrupt or unreadable" in run_cli(
        generate(model, "--lora-paths", f"a={cut}"), capsys)


def _word_tokenizer(path: Path) -> dict[str, int]:
    """A word-level tokenizer (not the byte one) saved in Hugging Face format."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<eos>": 1, "hello": 7, "world": 42, "again": 99}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<eos>").save_pretrained(str(path))
    return vocab


def test_tokenizer_path_is_used(tmp_path):  # R61
    vocab = _word_tokenizer(tmp_path / "tok")
    engine = Engine("tiny-llama", device="cpu", attention_backend="torch_native", max_total_tokens=256,
                    tokenizer_path=str(tmp_path / "tok"))
    out = engine.generate("hello world again", SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True))[0]
    assert out.prompt_token_ids == [vocab["hello"], vocab["world"], vocab["again"]]
    assert engine.decode([vocab["world"]]) == "world"


def test_tokenizer_path_without_a_tokenizer(tmp_path, capsys):  # R61
    err = run_cli(generate("tiny-llama", "--tokenizer-path", str(tmp_path)), capsys)
    assert f"--tokenizer-path '{tmp_path}': expected a directory holding one of tokenizer.json, " in err
