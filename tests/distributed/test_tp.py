"""Tensor parallelism on CPU (gloo, world size 2): every model class, with and without LoRA, gives
the greedy tokens and fp32 logits of tp size 1; a worker that fails ends the engine with its rank
and cause, without hanging.

Only one tensor-parallel engine runs at a time (torch.distributed's default group is per process),
so each test starts and shuts down its own. The first one starts the worker forkserver (~10 s);
the others start their workers in about a second.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from backplane import Engine, SamplingParams
from backplane.distributed import WorkerFailedError
from backplane.settings import ENV_TEST_FAIL_RANK
from helpers_models import forward_logits, make_hf_model, relative_error, tiny_hf_config, unused_slots
from lora_helpers import forward_requests, make_lora_world

ARCHS = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
# Qwen2 with one KV head: at tp 2 both ranks hold the same (replicated) KV head.
OVERRIDES = {"Qwen2ForCausalLM": dict(num_key_value_heads=1)}
GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 33, 2, 9], list(range(40, 61)), [7], [101, 3, 250, 77, 12, 6, 44, 199, 31]]
RTOL = 1e-4  # fp32: max |tp2 - tp1| / max |tp1|
CPU = dict(device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """arch -> directory of a saved tiny random model of that class."""
    out = {}
    for i, arch in enumerate(ARCHS):
        path = tmp_path_factory.mktemp(arch)
        make_hf_model(tiny_hf_config(arch, **OVERRIDES.get(arch, {})), seed=10 + i).save_pretrained(path)
        out[arch] = path
    return out


def serve(engine: Engine, prompts, lora=None, num_logit_prompts: int | None = None):
    """(greedy outputs of generate, (prefill logits, decode logits) of the first `num_logit_prompts`
    prompts); shuts a tensor-parallel engine down after."""
    try:
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora=lora)
        n = num_logit_prompts or len(prompts)
        first_tokens = [o.token_ids[0] for o in outs[:n]]
        if lora is None:
            logits = forward_logits(engine, prompts[:n], first_tokens)
        else:
            logits = forward_requests(engine, prompts[:n], lora[:n], first_tokens)
        return outs, logits
    finally:
        engine.shutdown()


def assert_same(tp1, tp2):
    (outs1, (prefill1, decode1)), (outs2, (prefill2, decode2)) = tp1, tp2
    assert [o.token_ids for o in outs2] == [o.token_ids for o in outs1]
    assert all(o.error is None for o in outs2)
    for o1, o2 in zip(outs1, outs2):
        torch.testing.assert_close(torch.tensor(o2.logprobs), torch.tensor(o1.logprobs), rtol=RTOL, atol=RTOL)
    assert prefill2.shape == prefill1.shape and decode2.shape == decode1.shape
    assert relative_error(prefill2, prefill1) < RTOL and relative_error(decode2, decode1) < RTOL


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_equals_tp1_for_every_model_class(arch, hf_dirs):
    path = str(hf_dirs[arch])
    tp1 = serve(Engine(path, max_total_tokens=1024, **CPU), PROMPTS)
    tp2_engine = Engine(path, max_total_tokens=1024, tp_size=2, **CPU)
    assert_same(tp1, serve(tp2_engine, PROMPTS))
    assert tp2_engine.runner.model.num_kv_heads == 1  # this rank's share of 2 KV heads, or the 1 replicated


def test_tp2_dummy_preset_with_chunked_prefill_and_preemption():
    """--load-format dummy draws the full tensors from --seed, so tp 1 and 2 serve the same model;
    a tight pool and small chunks exercise rank 0's slot decisions mirrored on rank 1."""
    prompts = [list(range(3, 3 + n)) for n in (40, 25, 50, 12)]
    tight = dict(model="tiny-llama", max_total_tokens=100, chunked_prefill_size=16, max_running_requests=3,
                 seed=7, **CPU)
    tp1 = serve(Engine(**tight), prompts, num_logit_prompts=2)
    tp2_engine = Engine(**tight, tp_size=2)
    tp2 = serve(tp2_engine, prompts, num_logit_prompts=2)
    assert_same(tp1, tp2)
    assert unused_slots(tp2_engine) == 100


def test_tp2_equals_tp1_with_prefix_cache_hits():
    """Rank 0's radix cache hands cached prefixes to new requests: the workers' rows get them too."""
    system = list(range(3, 53))
    prompts = [system + [60 + i, 61 + i] for i in range(4)] + [system[:40] + [90, 91]]
    settings = dict(model="tiny-llama", max_total_tokens=400, chunked_prefill_size=64, seed=7, **CPU)
    tp1 = serve(Engine(**settings), prompts, num_logit_prompts=2)
    tp2_engine = Engine(**settings, tp_size=2)
    tp2 = serve(tp2_engine, prompts, num_logit_prompts=2)
    assert_same(tp1, tp2)
    assert tp2_engine.stats()["prefix_cache"]["hit_tokens"] >= 4 * 40


def test_tp2_equals_tp1_with_lora(tmp_path_factory):
    """Mixed adapters (and eviction: 3 adapters, 2 slots); A/B sharded to match their base layers."""
    world = make_lora_world(tmp_path_factory.mktemp("tp_lora"))
    settings = dict(max_total_tokens=1024, lora_paths=world.lora_paths(), lora_backend="torch_native",
                    max_loras_per_batch=2, **CPU)
    adapters = ["all7_r4", None, "qv_down_r8", "kogu_r2"]
    tp1 = serve(Engine(str(world.base_dir), **settings), PROMPTS, adapters, num_logit_prompts=2)
    tp2 = serve(Engine(str(world.base_dir), tp_size=2, **settings), PROMPTS, adapters, num_logit_prompts=2)
    assert_same(tp1, tp2)


def test_worker_failing_to_start_names_rank_and_cause(monkeypatch):
    monkeypatch.setenv(ENV_TEST_FAIL_RANK, "1")
    start = time.monotonic()
    with pytest.raises(WorkerFailedError, match=r"tensor-parallel worker rank 1 failed: RuntimeError: "
                                                r"injected failure at start"):
        Engine("tiny-llama", tp_size=2, max_total_tokens=256, **CPU)
    assert time.monotonic() - start < 60
    monkeypatch.delenv(ENV_TEST_FAIL_RANK)
    engine = Engine("tiny-llama", tp_size=2, max_total_tokens=256, **CPU)  # nothing left behind
    assert len(engine.generate(input_ids=[[5, 6]], sampling_params=GREEDY)[0].token_ids) == 10
    engine.shutdown()


def test_worker_failing_in_a_forward_ends_the_engine(monkeypatch):
    monkeypatch.setenv(ENV_TEST_FAIL_RANK, "1:forward")
    engine = Engine("tiny-llama", tp_size=2, max_total_tokens=256, **CPU)
    with pytest.raises(WorkerFailedError, match="rank 1 failed: RuntimeError: injected failure at forward"):
        engine.generate(input_ids=[[5, 6, 7]], sampling_params=GREEDY)
    with pytest.raises(RuntimeError, match="tensor-parallel engine is shut down after an earlier failure: "
                                           "tensor-parallel worker rank 1 failed"):
        engine.runner.forward(None)
    assert not engine.tp.workers.processes[1].is_alive()


def test_killed_worker_ends_the_engine():
    engine = Engine("tiny-llama", tp_size=2, max_total_tokens=256, **CPU)
    process = engine.tp.workers.processes[1]
    os.kill(process.pid, signal.SIGKILL)
    process.join(10)
    start = time.monotonic()
    with pytest.raises(WorkerFailedError, match="rank 1 failed: the process was killed by signal 9"):
        engine.generate(input_ids=[[5, 6, 7]], sampling_params=GREEDY)
    assert time.monotonic() - start < 30


def test_shutdown_stops_the_workers():
    engine = Engine("tiny-llama", tp_size=2, max_total_tokens=256, **CPU)
    process = engine.tp.workers.processes[1]
    engine.shutdown()
    assert process.exitcode == 0
    engine.shutdown()  # twice is harmless


def test_speculative_decoding_is_refused_before_starting_workers():
    with pytest.raises(ValueError, match="--tp-size 2: speculative decoding .* is not supported"):
        Engine("tiny-llama", tp_size=2, speculative_algorithm="ngram", **CPU)


@pytest.mark.gpu
def test_plugin_loading_does_not_touch_cuda():
    code = ("import torch; from backplane.plugin.manager import load_plugins; load_plugins(); "
            "assert not torch.cuda.is_initialized(), 'a plugin initialised CUDA at load time'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.gpu
def test_tp2_equals_tp1_on_gpu_with_graphs():
    """NCCL collectives captured inside the decode graphs; fp32 so that greedy ties cannot flip."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    settings = dict(model="tiny-llama", device="cuda", dtype="float32", max_total_tokens=4096,
                    cuda_graph_max_bs=8)
    tp1 = serve(Engine(**settings), PROMPTS)
    tp2_engine = Engine(**settings, tp_size=2)
    assert tp2_engine.runner.graph_runner is not None
    assert_same(tp1, serve(tp2_engine, PROMPTS))


def test_ctrl_c_on_the_cli_stops_the_workers(monkeypatch, capsys):  # docs/reliability.md R65
    """Ctrl-C reaches every process of the group: the workers ignore it, rank 0 exits with one
    line and code 130 and stops them cleanly on the way out."""
    from backplane.cli import main

    seen = {}

    def interrupted(self, *args, **kwargs):
        worker = self.tp.workers.processes[1]
        os.kill(worker.pid, signal.SIGINT)  # as a terminal's Ctrl-C would
        time.sleep(0.5)
        seen["alive_after_sigint"] = worker.is_alive()
        seen["worker"] = worker
        raise KeyboardInterrupt

    monkeypatch.setattr(Engine, "generate", interrupted)
    argv = ["generate", "--model", "tiny-llama", "--device", "cpu", "--tp-size", "2", "--max-total-tokens", "256",
            "--input-ids", "5,6", "--max-new-tokens", "2"]
    assert main(argv) == 130
    assert capsys.readouterr().err == "backplane: interrupted\n"
    assert seen["alive_after_sigint"]
    seen["worker"].join(10)
    assert seen["worker"].exitcode == 0
