"""--enable-torch-compile without graphs (CPU, torch_native): greedy tokens equal the eager run's, and
the compiled forward reaches attention only through the opaque op torch.ops.backplane.attention."""

from __future__ import annotations

import pytest

from backplane import Engine, SamplingParams
from backplane.ops import opaque
from helpers_models import make_hf_model, tiny_hf_config

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [20]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("compile_model")
    make_hf_model(tiny_hf_config("LlamaForCausalLM", num_hidden_layers=1), seed=3).save_pretrained(
        path, safe_serialization=True)
    return str(path)


def _tokens(engine) -> list[list[int]]:
    params = [SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)] * len(PROMPTS)
    return [out.token_ids for out in engine.generate(input_ids=PROMPTS, sampling_params=params)]


def test_compiled_decode_matches_eager_through_the_opaque_op(model_dir, monkeypatch):
    kw = dict(device="cpu", dtype="float32", attention_backend="torch_native", max_total_tokens=1024,
              max_running_requests=4)
    want = _tokens(Engine(model_dir, **kw))
    calls = []
    real = opaque.current_batch
    monkeypatch.setattr(opaque, "current_batch", lambda: calls.append(1) or real())
    engine = Engine(model_dir, enable_torch_compile=True, **kw)
    assert engine.runner.compiled_eager is not None
    assert _tokens(engine) == want
    assert calls, "compiled decode never went through torch.ops.backplane.attention"
