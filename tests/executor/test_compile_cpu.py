"""--enable-torch-compile without graphs (CPU, torch_native): greedy tokens equal the eager run's, and
the compiled forward reaches attention only through the opaque op torch.ops.backplane.attention."""

from __future__ import annotations

import inspect

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
    real = opaque.bound_batch
    monkeypatch.setattr(opaque, "bound_batch", lambda layer: calls.append(1) or real(layer))
    engine = Engine(model_dir, enable_torch_compile=True, **kw)
    assert engine.runner.compiled_eager is not None
    assert _tokens(engine) == want
    assert calls, "compiled decode never went through torch.ops.backplane.attention"


def test_compiled_triton_decode_keeps_the_fused_rotary_kv_write(monkeypatch):
    """A backend that opts in to `fuses_rotary_kv_write` (triton, under the interpreter) gets the
    same fused op under compile: rotary runs inside torch.ops.backplane.rotary_attention, not as
    Inductor's rotary followed by the backend's own K/V write. Tokens equal the uncompiled run's."""
    from backplane.layers import attention

    kw = dict(device="cpu", dtype="float32", attention_backend="triton", max_total_tokens=1024,
              max_running_requests=4)
    want = _tokens(Engine("tiny-llama", **kw))  # head dim 64: a size the triton kernels take
    fused_in_op = []
    real = attention.Attention._forward_rotary_kv_write

    def spy(self, *args):
        # called by the compiled forward's opaque op, not by an eager forward
        fused_in_op.append(any(frame.function == "rotary_attention" for frame in inspect.stack()))
        return real(self, *args)

    monkeypatch.setattr(attention.Attention, "_forward_rotary_kv_write", spy)
    engine = Engine("tiny-llama", enable_torch_compile=True, **kw)
    assert engine.runner.compiled_eager is not None
    assert _tokens(engine) == want
    assert any(fused_in_op), "the compiled decode never ran rotary_kv_write inside the opaque op"
