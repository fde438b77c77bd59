"""Speculative decoding through the triton backend's two TARGET_VERIFY kernels (CPU, the Triton
interpreter, fp32): greedy output equals plain greedy decoding with either kernel."""

from __future__ import annotations

import pytest
import torch

from backplane import Engine, SamplingParams
from helpers_models import unused_slots

if torch.cuda.is_available():
    pytest.skip("the interpreter run is for CPU machines; tests/gpu covers the GPU", allow_module_level=True)
pytest.importorskip("triton")

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [40, 41, 42, 43, 40, 41, 42]]


def _generate(**kw) -> list[list[int]]:
    engine = Engine("tiny-llama", device="cpu", attention_backend="triton", max_total_tokens=2048, **kw)
    outs = engine.generate(input_ids=PROMPTS, sampling_params=SamplingParams(max_new_tokens=10, temperature=0.0,
                                                                             ignore_eos=True))
    assert all(o.error is None for o in outs)
    assert unused_slots(engine) == 2048
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    """Plain greedy decoding, the same for both kernels' runs (computed once)."""
    return _generate()


@pytest.mark.parametrize("verify_kernel", ["extend", "split"])
def test_ngram_greedy_equals_plain_with_each_verify_kernel(verify_kernel, plain, monkeypatch):
    from backplane.plugins.attention_triton import backend

    calls = {"split": 0, "extend": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(backend, "verify_attention", counted("split", backend.verify_attention))
    monkeypatch.setattr(backend, "extend_attention", counted("extend", backend.extend_attention))
    spec = _generate(speculative_algorithm="ngram", speculative_num_draft_tokens=4,
                     plugin_options={"triton-attention": {"verify_kernel": verify_kernel}})
    assert spec == plain
    if verify_kernel == "split":
        assert calls["split"] > 0  # every verify layer; the extend kernel still serves the prefills
    else:
        assert calls["split"] == 0 and calls["extend"] > 0
