"""Speculative decoding with LoRA on CPU: on a mixed batch (two adapters and base requests), greedy
ngram and EAGLE output equals non-speculative LoRA output token for token, for the torch_native and
the (interpreted) triton LoRA backends; each verify batch gives every token of a request that
request's adapter. EAGLE's draft head runs without adapters (LoRA applies to the target only)."""

from __future__ import annotations

import os

import pytest

from backplane import Engine, SamplingParams
from helpers_models import save_exact_eagle_head, unused_slots
from lora_helpers import ADAPTERS, make_lora_world

NAMES = ["all7_r4", "qv_down_r8"]
# Motifs repeat so that ngram lookup proposes, and verify accepts, several tokens per step.
PROMPTS = [[5, 17, 33] * 3, list(range(40, 51)), [7, 8] * 4, [101, 3, 250, 77], [12, 13, 14] * 2, [9]]
MIXED = ["all7_r4", None, "qv_down_r8", "all7_r4", None, "qv_down_r8"]
SPECS = {
    "ngram": dict(speculative_algorithm="ngram", speculative_num_draft_tokens=4),
    "eagle": dict(speculative_algorithm="eagle", speculative_num_steps=3, speculative_eagle_topk=1,
                  speculative_num_draft_tokens=4),
}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_lora")
    world = make_lora_world(root, {n: ADAPTERS[n] for n in NAMES}, num_hidden_layers=1)
    world.eagle_head = save_exact_eagle_head(world.merged[None], root / "eagle")
    return world


def _engine(world, lora_backend: str, **kwargs) -> Engine:
    return Engine(str(world.base_dir), device="cpu", dtype="float32", attention_backend="torch_native",
                  max_total_tokens=1024, max_running_requests=8, lora_paths=world.lora_paths(),
                  lora_backend=lora_backend, max_loras_per_batch=2, **kwargs)


def _generate(engine, max_new: int):
    params = [SamplingParams(max_new_tokens=max_new - i % 3, temperature=0.0, ignore_eos=True)
              for i in range(len(PROMPTS))]
    outs = engine.generate(input_ids=PROMPTS, sampling_params=params, lora=MIXED)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return outs


def _spec_kwargs(world, name: str) -> dict:
    extra = dict(speculative_draft_model=world.eagle_head) if name == "eagle" else {}
    return {**SPECS[name], **extra}


@pytest.mark.parametrize("lora_backend", ["torch_native", "triton"])
@pytest.mark.parametrize("algorithm", ["ngram", "eagle"])
def test_spec_with_lora_equals_plain_lora(world, algorithm, lora_backend):
    if lora_backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU run of Triton needs TRITON_INTERPRET=1")
    max_new = 8 if lora_backend == "torch_native" else 5
    want = _generate(_engine(world, lora_backend), max_new)
    spec = _engine(world, lora_backend, **_spec_kwargs(world, algorithm))
    ctx = spec.spec_worker.ctx
    assert ctx.runner.model is spec.runner.model and tuple(ctx.participants) == (spec.lora_manager,)
    verify_segments = []
    original = spec.lora_manager.prepare_batch

    def spy(batch, reqs):
        original(batch, reqs)
        if batch.forward_mode.value == "target_verify":
            segments = batch.plugin_inputs["lora"]
            verify_segments.append((list(segments.seg_lens), list(segments.slots), [r.lora for r in reqs]))

    spec.lora_manager.prepare_batch = spy
    got = _generate(spec, max_new)
    for i, (w, g) in enumerate(zip(want, got)):
        assert g.token_ids == w.token_ids, f"request {i} ({MIXED[i]})"
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4), f"request {i} ({MIXED[i]})"
    assert verify_segments, "no verify batch went through the LoRA manager"
    slot_of = spec.lora_manager.pool.slot_of
    for seg_lens, slots, names in verify_segments:  # one segment of num_draft_tokens per request
        assert seg_lens == [SPECS[algorithm]["speculative_num_draft_tokens"]] * len(names)
        assert slots == [slot_of[n] if n else 0 for n in names]
    assert max(spec.spec_worker.stats.histogram) > 1, "verify never accepted a draft token"
    assert unused_slots(spec) == 1024


def test_adapters_change_the_greedy_output(world):
    """The equality above is not vacuous: each adapter's output differs from the base model's."""
    engine = _engine(world, "torch_native")
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = [PROMPTS[0]]
    outs = {n: engine.generate(input_ids=prompt, sampling_params=params, lora=n)[0].token_ids for n in [None, *NAMES]}
    assert outs[None] != outs["all7_r4"] and outs[None] != outs["qv_down_r8"], outs
