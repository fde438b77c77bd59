"""What a decode step costs the LoRA side: nothing when no request uses an adapter, and no batch
info copy when a step has the same requests as the one before (triton backend, interpreted)."""

import os

import pytest

from backplane import Engine, SamplingParams
from lora_helpers import make_lora_world, with_fake_graphs

STEPS = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 33, 2, 9], [7, 8], [40, 41, 42]]
BACKEND_CALLS = ("prepare_batch", "apply_lora", "lora_a", "lora_b", "qkv_lora_b", "gate_up_lora_b",
                 "init_metadata_for_capture", "init_metadata_for_replay")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU run of Triton needs TRITON_INTERPRET=1")
    world = make_lora_world(tmp_path_factory.mktemp("lora-decode"))
    engine = Engine(str(world.base_dir), device="cpu", dtype="float32", max_total_tokens=512,
                    max_running_requests=4, lora_paths=world.lora_paths(), lora_backend="triton",
                    max_loras_per_batch=3, cuda_graph_bs=[1, 2, 4],
                    plugin_options={"triton-lora": {"decode_path": "fused"}})
    engine.graphs = with_fake_graphs(engine)  # the graph runner's keys, padding and replay binding
    return engine


def record_backend_calls(monkeypatch, backend) -> list[str]:
    calls = []
    for name in BACKEND_CALLS:
        original = getattr(backend, name)
        monkeypatch.setattr(backend, name, lambda *a, _n=name, _f=original, **k: (calls.append(_n), _f(*a, **k))[1])
    return calls


def test_base_only_batches_never_touch_the_lora_backend(engine, monkeypatch):
    manager = engine.lora_manager
    calls = record_backend_calls(monkeypatch, manager.backend)
    copies = manager.info.num_device_copies, manager.graph_info.num_device_copies
    engine.graphs.replayed.clear()
    outs = engine.generate(input_ids=PROMPTS, sampling_params=STEPS, lora=None)
    assert [len(o.token_ids) for o in outs] == [5, 5, 5]
    assert calls == []
    assert {(k.batch_size, dict(k.extras)["lora"]) for k in engine.graphs.replayed} == {(4, False)}
    assert (manager.info.num_device_copies, manager.graph_info.num_device_copies) == copies


def test_decode_steps_of_the_same_requests_copy_no_batch_info(engine, monkeypatch):
    manager = engine.lora_manager
    calls = record_backend_calls(monkeypatch, manager.backend)
    before = manager.info.num_device_copies
    graph_before = manager.graph_info.num_device_copies
    engine.graphs.replayed.clear()
    engine.generate(input_ids=PROMPTS, sampling_params=STEPS, lora=["all7_r4", None, "kogu_r2"])
    # the eager info: one copy, for the prefill (the decode steps replay graphs and never touch it)
    assert manager.info.num_device_copies - before == 1
    assert manager.graph_info.num_device_copies - graph_before == 1  # the padded decode batch, once
    assert {(k.batch_size, dict(k.extras)["lora"]) for k in engine.graphs.replayed} == {(4, True)}
    assert calls.count("init_metadata_for_replay") == 4 and "apply_lora" in calls and "lora_a" not in calls


def test_folded_decode_path_generates_what_the_fused_one_does(engine, tmp_path, monkeypatch):
    """--triton-lora.decode-path folded (the default; the module's engine takes `fused`): passes of at most 64 tokens (here the 10-token prefill and the
    padded decode steps) run the base GEMM over [W; A] and one expand per projection, and greedy
    tokens equal the fused path's."""
    from backplane.plugins.lora_triton import folded

    adapters = ["all7_r4", None, "kogu_r2"]
    fused_out = [o.token_ids for o in engine.generate(input_ids=PROMPTS, sampling_params=STEPS, lora=adapters)]
    world = make_lora_world(tmp_path)
    folded_engine = Engine(str(world.base_dir), device="cpu", dtype="float32", max_total_tokens=512,
                           max_running_requests=4, lora_paths=world.lora_paths(), lora_backend="triton",
                           max_loras_per_batch=3, cuda_graph_bs=[1, 2, 4])
    folded_engine.graphs = with_fake_graphs(folded_engine)
    expands = []
    real = folded.folded_expand
    monkeypatch.setattr(folded, "folded_expand", lambda *a, **k: expands.append(a[0].shape[0]) or real(*a, **k))
    outs = folded_engine.generate(input_ids=PROMPTS, sampling_params=STEPS, lora=adapters)
    assert [o.token_ids for o in outs] == fused_out
    layers = folded_engine.lora_manager.layers
    assert set(expands) == {10, 4}, "the prefill (10 tokens) and the padded decode batches (4) fold"
    assert len(expands) == 5 * len(layers)  # one prefill and four decode steps, every projection once
    assert all(layer.w_ext is not None for layer in layers)
