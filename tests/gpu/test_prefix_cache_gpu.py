"""The radix cache on the GPU with CUDA graphs: greedy outputs with the cache equal those without
it, for shared, partly shared and unshared prompts, with LoRA adapters beside base requests, on
both GPU attention backends; the second round really hits the cache; the pool is whole afterwards.

triton runs in fp32, which keeps the comparison exact: the cache changes which tokens a prefill
computes and how batches are formed, which in half precision may flip near-ties (the benchmark's
"greedy equal" column counts those). FlashInfer takes no fp32, so it runs in fp16 and a divergence
passes only where the fp32 PEFT-merged model is near a tie at the first differing token."""

from __future__ import annotations

import pytest
import torch

from backplane import Engine, SamplingParams
from helpers_models import unused_slots
from lora_helpers import make_lora_world

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
SYSTEM = [5 + (7 * i) % 280 for i in range(200)]  # a 200-token shared prefix (vocabulary 300)
PROMPTS = ([SYSTEM + [250 + i, 7, 8 + i] for i in range(6)]  # shared
           + [SYSTEM[:90] + [260 + i] * 5 for i in range(4)]  # partly shared
           + [[270 + i, 9, 40 + i, 11] * 12 for i in range(4)])  # unshared
ADAPTERS = ["all7_r4", None, "qv_down_r8", None, "all7_r4", None, None, "kogu_r2",
            None, "all7_r4", None, "qv_down_r8", None, None]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return make_lora_world(tmp_path_factory.mktemp("prefix_gpu"), hidden_size=256, head_dim=64)


DTYPES = {"triton": "float32", "flashinfer": "float16"}
TIE_FRACTION = 0.05  # of the fp32 logits' standard deviation (as tests/gpu/greedy_ties.py)


def two_rounds(world, backend: str, **settings):
    engine = Engine(str(world.base_dir), device="cuda", dtype=DTYPES[backend], attention_backend=backend,
                    lora_paths=world.lora_paths(), lora_backend="triton", max_loras_per_batch=4,
                    cuda_graph_max_bs=16, **settings)
    assert engine.runner.graph_runner is not None
    start = unused_slots(engine)
    first = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, lora=ADAPTERS)
    second = engine.generate(input_ids=PROMPTS[::-1], sampling_params=GREEDY, lora=ADAPTERS[::-1])[::-1]
    assert all(o.error is None for o in first + second)
    assert unused_slots(engine) == start
    return [o.token_ids for o in first + second], engine.stats()["prefix_cache"]


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
@pytest.mark.parametrize("settings", [dict(max_total_tokens=8192),
                                      dict(max_total_tokens=700, chunked_prefill_size=64, max_running_requests=4)],
                         ids=["roomy", "tight"])
def test_greedy_outputs_equal_without_the_cache(world, backend, settings):
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    settings = {"max_running_requests": 16, **settings}
    plain, off = two_rounds(world, backend, disable_radix_cache=True, **settings)
    cached, on = two_rounds(world, backend, **settings)
    assert not off["enabled"] and on["enabled"]
    assert on["hit_tokens"] > len(SYSTEM) * 4, on  # round one shares the system prompt, round two all of it
    prompts, adapters = PROMPTS + PROMPTS, ADAPTERS + ADAPTERS
    wrong = []
    for i, (a, b) in enumerate(zip(plain, cached)):
        j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if j is None:
            assert len(a) == len(b)
            continue
        margin = tie_margin(world.merged[adapters[i]], prompts[i] + a[:j], a[j], b[j])
        if DTYPES[backend] == "float32" or margin > TIE_FRACTION:
            wrong.append((i, j, round(margin, 4)))
    assert not wrong, f"(request, position, margin/std) differ with the cache ({backend}, {settings}): {wrong}"


@torch.inference_mode()
def tie_margin(model, ids: list[int], want: int, got: int) -> float:
    """|logit(want) - logit(got)| / std(logits) of the fp32 transformers model after `ids`."""
    logits = model(torch.tensor([ids])).logits[0, -1].float()
    return float((logits[want] - logits[got]).abs() / logits.std())
