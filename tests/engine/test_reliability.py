"""Bad input, one row per entry of docs/reliability.md: a one-line error, exit code 2, nothing else hurt.

CLI rows run `backplane` in-process and expect exit code 2 with exactly one line on stderr that
contains the row's fragment. Engine rows send the bad request between two good ones in one
`generate` call and expect it alone to fail (finish_reason "abort", the fragment in `error`),
the good ones to come back exactly as when run alone, and the KV pool to be whole again.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backplane import AttentionBackendSpec, Engine, SamplingParams
from backplane.attention import TorchNativeAttnBackend
from backplane.cli import main
from backplane.plugin.hookspecs import hookimpl
from helpers_models import unused_slots

POISON = 499  # the boom backend fails any batch whose input ids contain this token
GOOD = [[5, 17, 33, 2, 9], [101, 3, 250, 77, 12, 6, 44]]
PARAMS = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
TINY = ["--model", "tiny-llama", "--device", "cpu", "--attention-backend", "torch_native"]
GEN = ["generate", *TINY, "--max-new-tokens", "2", "--input-ids", "5,6"]
TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
               "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
               "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 256}


def _dir(root: Path, name: str, files: dict[str, str | bytes]) -> str:
    path = root / name
    path.mkdir()
    for file, content in files.items():
        (path / file).write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(path)


def _adapter(rank: int, targets: list[str]) -> dict[str, str]:
    return {"adapter_config.json": json.dumps({"r": rank, "lora_alpha": 16, "target_modules": targets})}


@pytest.fixture(scope="module")
def bad_dirs(tmp_path_factory) -> dict[str, str]:
    """Tiny broken model and adapter directories, by name."""
    root = tmp_path_factory.mktemp("bad")
    config = json.dumps(TINY_CONFIG)
    return {
        "missing": str(root / "no_such_model"),
        "no_config": _dir(root, "no_config", {"model.safetensors": b"\x00" * 16}),
        "corrupt": _dir(root, "corrupt", {"config.json": config, "model.safetensors": b"not a safetensors file"}),
        "unknown_arch": _dir(root, "unknown_arch", {"config.json": config.replace("LlamaForCausalLM", "FooForCausalLM")}),
        "no_weights": _dir(root, "no_weights", {"config.json": config}),
        "ad_no_config": _dir(root, "ad_no_config", {"adapter_model.safetensors": b"\x00" * 16}),
        "ad_rank": _dir(root, "ad_rank", _adapter(64, ["q_proj"])),
        "ad_target": _dir(root, "ad_target", _adapter(4, ["lm_head"])),
        "ad_json": _dir(root, "ad_json", {"adapter_config.json": "{r: 4"}),
    }


# (id, argv (with {name} filled from bad_dirs), env vars, fragment of the one stderr line)
CLI_ROWS = [
    # CLI flags
    ("R01", ["frobnicate"], {}, "invalid choice: 'frobnicate' (choose from 'plugins', 'generate', 'bench', 'serve')"),
    ("R02", ["generate", "--no-such-flag"], {}, "unrecognized arguments: --no-such-flag"),
    ("R03", ["generate", "--device", "tpu"], {}, "--device (env BACKPLANE_DEVICE): invalid value 'tpu': "
                                                 "Input should be 'auto', 'cpu' or 'cuda'"),
    ("R04", ["generate", "--dtype", "float8"], {}, "--dtype (env BACKPLANE_DTYPE): invalid value 'float8': "
                                                   "Input should be 'auto', 'float32', 'float16' or 'bfloat16'"),
    ("R05", ["generate", "--seed", "-1"], {}, "--seed (env BACKPLANE_SEED): invalid value '-1': "
                                              "Input should be greater than or equal to 0"),
    ("R06", ["generate", "--mem-fraction-static", "1.5"], {}, "invalid value '1.5': Input should be less than 1"),
    ("R07", ["generate", "--cuda-graph-bs", "4", "4"], {}, "--cuda-graph-bs (env BACKPLANE_CUDA_GRAPH_BS): "
                                                           "invalid value ['4', '4']: expected distinct batch sizes"),
    ("R08", [*GEN, "--attention-backend", "nope"], {}, "--attention-backend: unknown backend 'nope'; registered: "),
    ("R09", ["generate", "--custom-ops", "rms_norm"], {}, "expected op=implementation, got 'rms_norm'"),
    ("R10", [*GEN, "--custom-ops", "rms_norm=nope"], {}, "custom op override 'rms_norm=nope': unknown "
                                                         "implementation 'nope' for op 'rms_norm' on cpu; registered: native"),
    ("R11", [*GEN, "--speculative-algorithm", "nope"], {}, "--speculative-algorithm 'nope': unknown; registered algorithms:"),
    ("R12", ["generate", "--lora-paths", "adapter_dir"], {}, "--lora-paths (env BACKPLANE_LORA_PATHS): invalid value "
                                                             "['adapter_dir']: expected name=path, got 'adapter_dir'"),
    ("R13", [*GEN, "--max-new-tokens", "ten"], {}, "argument --max-new-tokens: invalid int value: 'ten'"),
    # Environment variables
    ("R14", GEN, {"BACKPLANE_SEED": "x"}, "--seed (env BACKPLANE_SEED): invalid value 'x': Input should be a valid integer"),
    ("R15", GEN, {"BACKPLANE_TP_SIZE": "0"}, "--tp-size (env BACKPLANE_TP_SIZE): invalid value '0': "
                                             "Input should be greater than or equal to 1"),
    ("R16", GEN, {"BACKPLANE_STRICT_PLUGINS": "maybe"}, "--strict-plugins (env BACKPLANE_STRICT_PLUGINS): "
                                                        "invalid value 'maybe': Input should be a valid boolean"),
    ("R17", GEN, {"BACKPLANE_LORA_PATHS": "a=x,a=y"}, "--lora-paths (env BACKPLANE_LORA_PATHS): invalid value "
                                                      "'a=x,a=y': expected distinct adapter names"),
    ("R18", GEN, {"BACKPLANE_LOG_LEVEL": "loud"}, "--log-level (env BACKPLANE_LOG_LEVEL): invalid value 'loud': "
                                                  "Input should be 'debug', 'info', 'warning' or 'error'"),
    # Model directories
    ("R19", ["generate", "--device", "cpu", "--model", "{missing}", "--input-ids", "5"], {},
     "': expected a local Hugging Face model directory or a preset name; presets: "),
    ("R20", ["generate", "--device", "cpu", "--model", "{no_config}", "--input-ids", "5"], {},
     "': expected a config.json in it, found none"),
    ("R21", ["generate", "--device", "cpu", "--model", "{corrupt}", "--input-ids", "5"], {},
     "model.safetensors' is corrupt or unreadable: "),
    ("R22", ["generate", "--device", "cpu", "--model", "{unknown_arch}", "--input-ids", "5"], {},
     "model architecture 'FooForCausalLM' is not registered; registered: Gemma2ForCausalLM, Gemma3ForCausalLM, "
     "LlamaForCausalLM"),
    ("R23", ["generate", "--device", "cpu", "--model", "{no_weights}", "--input-ids", "5"], {},
     "': expected model.safetensors or model.safetensors.index.json, found neither"),
    # LoRA adapters
    ("R24", [*GEN, "--lora-paths", "a={ad_no_config}"], {}, "adapter_config.json to exist, but it is missing"),
    ("R25", [*GEN, "--lora-paths", "a={ad_rank}", "--max-lora-rank", "8"], {},
     "rank r=64 is above --max-lora-rank 8; raise --max-lora-rank to at least 64"),
    ("R26", [*GEN, "--lora-paths", "a={ad_target}"], {},
     "target module 'lm_head' is not a projection this model has LoRA support for; expected some of q_proj, "),
    ("R27", [*GEN, "--lora-paths", "a={ad_json}"], {}, "adapter_config.json): expected JSON, got a parse error"),
    # Prompts (CLI)
    ("R28", ["generate", "--input-ids", "1,x"], {}, "expected comma-separated integers such as 1,2,3, got '1,x'"),
    ("R29", ["generate", "--input-ids=-1,2"], {}, "expected token ids >= 0, got '-1,2'"),
    ("R30", [*GEN, "--prompt", "hi"], {}, "--prompt and --input-ids: pass one or the other, not both"),
    # Sampling parameters
    ("R31", [*GEN, "--temperature", "-1"], {}, "SamplingParams.temperature: expected >= 0 (0 is greedy), got -1.0"),
    ("R32", [*GEN, "--top-p", "0"], {}, "SamplingParams.top_p: expected in (0, 1], got 0.0"),
    ("R33", [*GEN, "--top-k", "-5"], {}, "SamplingParams.top_k: expected an integer >= 1, or 0/-1 for no limit, got -5"),
    ("R34", [*GEN, "--min-p", "2"], {}, "SamplingParams.min_p: expected in [0, 1], got 2.0"),
    ("R35", [*GEN, "--max-new-tokens", "0"], {}, "SamplingParams.max_new_tokens: expected an integer >= 1, got 0"),
    ("R36", [*GEN, "--stop", ""], {}, "SamplingParams.stop: expected non-empty strings, got ['']"),
    # Plugins (strict mode makes a broken plugin fatal; without it, it is listed with its error)
    ("R37", ["plugins", "--strict-plugins"], {"BACKPLANE_PLUGINS": "bad_import"},
     "plugin 'bad_import' (backplane_bad_plugins.bad_import) failed to load: ImportError: bad_import plugin: "
     "simulated missing dependency"),
    ("R38", ["plugins", "--strict-plugins"], {"BACKPLANE_PLUGINS": "bad_register"},
     "failed to load: RuntimeError: bad_register plugin: exploded while registering"),
]
PLUGIN_ROWS = {"R37", "R38"}


@pytest.mark.parametrize("row, argv, env, fragment", CLI_ROWS, ids=[r[0] for r in CLI_ROWS])
def test_cli_bad_input(row, argv, env, fragment, bad_dirs, monkeypatch, capsys, request):
    if row in PLUGIN_ROWS:
        request.getfixturevalue("bad_plugins")  # installs the broken plugin distribution
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    argv = [word.format(**bad_dirs) for word in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("backplane: error: "), err
    assert fragment in err


class BoomPlugin:
    """A throwaway plugin: attention backend "boom", the reference arithmetic, except that it raises
    for any batch whose input ids contain POISON."""

    @hookimpl
    def backplane_register_attention_backends(self, register):
        register(AttentionBackendSpec(name="boom", factory=BoomBackend, description="fails on token 499",
                                      platforms=("cpu",)))


class BoomBackend(TorchNativeAttnBackend):
    decode_poison: int | None = None  # also fail decode batches whose input holds this token

    def forward(self, q, k, v, layer, batch):
        if bool((batch.input_ids == POISON).any()):
            raise RuntimeError(f"boom: token {POISON} in the batch")
        poison = type(self).decode_poison
        if poison is not None and batch.forward_mode.is_decode and bool((batch.input_ids == poison).any()):
            raise RuntimeError(f"boom: decode of token {poison}")
        return super().forward(q, k, v, layer, batch)


@pytest.fixture(scope="module")
def engine():
    return Engine("tiny-llama", device="cpu", attention_backend="boom", plugins=[BoomPlugin()],
                  max_total_tokens=1024, max_running_requests=8)


@pytest.fixture(scope="module")
def reference(engine) -> list[list[int]]:
    return [engine.generate(input_ids=[ids], sampling_params=PARAMS)[0].token_ids for ids in GOOD]


# (id, keyword arguments of generate for the bad request, fragment of its error)
ENGINE_ROWS = [
    ("R39", dict(input_ids=[]), "empty prompt; expected at least one token"),
    ("R40", dict(input_ids=[7] * 2097), "prompt of 2097 tokens + max_new_tokens 6 exceeds the context length 2048"),
    ("R41", dict(input_ids=[5, 99999, 6]), "token id 99999 is outside the vocabulary; expected ids in [0, "),
    ("R42", dict(input_ids=[5, -3]), "token id -3 is outside the vocabulary"),
    ("R43", dict(input_ids=[5, 6], lora="nope"), "unknown LoRA adapter 'nope'; loaded: none"),
    ("R44", dict(input_ids=[7, POISON, 8]), "forward pass failed: RuntimeError: boom: token 499 in the batch"),
]


@pytest.mark.parametrize("row, bad, fragment", ENGINE_ROWS, ids=[r[0] for r in ENGINE_ROWS])
def test_bad_request_fails_alone(row, bad, fragment, engine, reference):
    req_pool = engine.runner.req_to_token_pool
    free_slots, free_rows = unused_slots(engine), req_pool.num_free
    outs = engine.generate(input_ids=[GOOD[0], bad["input_ids"], GOOD[1]], sampling_params=PARAMS,
                           lora=[None, bad.get("lora"), None])
    failed = outs[1]
    assert failed.finish_reason == "abort" and fragment in failed.error, failed.error
    assert "\n" not in failed.error
    for out, expected in zip((outs[0], outs[2]), reference):
        assert out.error is None and out.finish_reason == "length"
        assert out.token_ids == expected
    assert unused_slots(engine) == free_slots and req_pool.num_free == free_rows


def test_engine_serves_normally_after_a_failed_forward(engine, reference):
    engine.generate(input_ids=[[POISON, 3]], sampling_params=PARAMS)
    outs = engine.generate(input_ids=GOOD, sampling_params=PARAMS)
    assert [o.token_ids for o in outs] == reference


def test_decode_failure_aborts_only_its_request(engine, reference, monkeypatch):
    """GOOD[1]'s first token is reference[1][0]; a backend failing on decoding it (inside a batch
    with GOOD[0]) leaves GOOD[0] to complete and aborts GOOD[1] alone."""
    free = unused_slots(engine)
    monkeypatch.setattr(BoomBackend, "decode_poison", reference[1][0])
    assert reference[1][0] not in reference[0]
    outs = engine.generate(input_ids=GOOD, sampling_params=PARAMS)
    assert outs[0].error is None and outs[0].token_ids == reference[0]
    assert outs[1].finish_reason == "abort" and f"boom: decode of token {reference[1][0]}" in outs[1].error
    assert outs[1].token_ids == reference[1][:1]
    assert unused_slots(engine) == free


def test_table_lists_every_row():
    table = (Path(__file__).resolve().parents[2] / "docs" / "reliability.md").read_text()
    rows = [r[0] for r in CLI_ROWS + ENGINE_ROWS]
    assert rows == [f"R{i:02d}" for i in range(1, len(rows) + 1)] and len(rows) >= 30
    for row in rows:
        assert f"| {row} |" in table, row


def test_unknown_lora_backend_without_adapters_is_an_error(capsys):
    assert main(["generate", "--model", "tiny-llama", "--device", "cpu", "--lora-backend", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--lora-backend: unknown backend 'nope'; registered: " in err and "torch_native (plugin 'lora.builtin')" in err
