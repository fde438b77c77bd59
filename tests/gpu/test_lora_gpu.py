"""Multi-LoRA serving on the GPU in bf16: both bundled backends pass the LoRA conformance suite with
real CUDA-graph replay; a mixed batch whose decode replays a captured LoRA graph equals the
PEFT-merged transformers models; graph replay equals eager over a generate workload that mixes
adapters, base-only batches and slot eviction."""

from __future__ import annotations

import random

import pytest
import torch

from backplane import Engine, SamplingParams
from backplane.contracts.model import ModelOutput
from backplane.testing import lora_conformance
from helpers_models import relative_error, unused_slots
from lora_helpers import forward_requests, hf_logits, make_lora_world

pytestmark = pytest.mark.gpu

BACKENDS = ["triton", "torch_native", "triton-fused"]  # triton: decode path folded (default); triton-fused: fused
TOLERANCE = 5e-2  # bf16 against fp32 transformers (as in test_models_vs_hf)
PROMPTS = [[5, 17, 33, 2, 9], list(range(40, 53)), [7], [101, 3, 250, 77], [12, 13, 14], [8, 200, 31]]
MIXED = ["all7_r4", None, "qv_down_r8", "kogu_r2", "all7_r4", None]
NEXT_TOKENS = [11, 29, 3, 250, 64, 1]

test_triton_conformance = lora_conformance.make_suite("triton", device="cuda")
test_torch_native_conformance = lora_conformance.make_suite("torch_native", device="cuda")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    # head dim 64: the GPU attention backends (which capture graphs) do not take the CPU tests' 16
    return make_lora_world(tmp_path_factory.mktemp("lora_gpu"), hidden_size=256, head_dim=64)


def gpu_engine(world, backend: str, **kwargs) -> Engine:
    if backend == "triton-fused":  # one shrink-and-expand kernel per projection group after the base GEMM
        backend, kwargs = "triton", {**kwargs, "plugin_options": {"triton-lora": {"decode_path": "fused"}}}
    settings = dict(device="cuda", dtype="bfloat16", max_total_tokens=8192, max_running_requests=32,
                    cuda_graph_max_bs=16, lora_paths=world.lora_paths(), max_loras_per_batch=3,
                    lora_backend=backend)
    return Engine(str(world.base_dir), **{**settings, **kwargs})


def record_replays(engine) -> list:
    """Patch the graph runner so that every replayed GraphKey is appended to the returned list."""
    graphs = engine.runner.graph_runner
    assert graphs is not None, "CUDA graphs were not captured"
    keys, original = [], graphs.replay

    def replay(batch, key=None):
        keys.append(key or graphs.key_for(batch))
        return original(batch, key)

    graphs.replay = replay
    return keys


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_batch_with_graphs_equals_merged_models(world, backend):
    engine = gpu_engine(world, backend)
    keys = record_replays(engine)
    prefill, decode = forward_requests(engine, PROMPTS, MIXED, NEXT_TOKENS)
    assert [(k.batch_size, dict(k.extras)["lora"]) for k in keys] == [(8, True)], "decode did not replay a LoRA graph"
    start = 0
    for i, (prompt, name) in enumerate(zip(PROMPTS, MIXED)):
        expected = hf_logits(world.merged[name], prompt + [NEXT_TOKENS[i]])
        err_prefill = relative_error(prefill[start : start + len(prompt)], expected[: len(prompt)])
        err_decode = relative_error(decode[i], expected[-1])
        assert err_prefill < TOLERANCE and err_decode < TOLERANCE, f"request {i} ({name}): {err_prefill}, {err_decode}"
        start += len(prompt)


@pytest.mark.parametrize("backend", BACKENDS)
def test_graph_replay_equals_eager_with_adapters_and_eviction(world, backend):
    engine = gpu_engine(world, backend, max_loras_per_batch=2)  # 3 adapters on 2 slots
    runner, graphs = engine.runner, engine.runner.graph_runner
    assert graphs is not None
    replayed = {True: 0, False: 0}

    @torch.inference_mode()
    def checked_forward(batch):
        if not graphs.can_run(batch):
            return runner.forward_eager(batch)
        lora_on = dict(graphs.key_for(batch).extras)["lora"]
        graph_logits = graphs.replay(batch).logits.clone()
        eager_logits = runner.forward_eager(batch).logits
        torch.testing.assert_close(graph_logits, eager_logits, atol=3e-2, rtol=3e-2)
        replayed[lora_on] += 1
        return ModelOutput(graph_logits)

    runner.forward = checked_forward
    rng = random.Random(0)
    names = [None, *world.adapter_dirs]
    prompts = [[rng.randrange(3, 290) for _ in range(rng.randint(1, 40))] for _ in range(24)]
    params = [SamplingParams(max_new_tokens=rng.randint(2, 20), temperature=0, ignore_eos=True) for _ in prompts]
    outs = engine.generate(input_ids=prompts, sampling_params=params, lora=[names[i % 4] for i in range(24)])
    base_only = engine.generate(input_ids=prompts[:5], sampling_params=params[:5])
    assert all(o.error is None for o in outs + base_only)
    assert replayed[True] > 0 and replayed[False] > 0, f"replays by LoRA on/off: {replayed}"
    assert engine.lora_manager.pool.num_evictions > 0
    assert unused_slots(engine) == 8192
