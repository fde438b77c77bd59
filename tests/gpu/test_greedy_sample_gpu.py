"""The Triton `greedy_sample` on the GPU: against the native op over real vocabularies, ties to the
first index, the two results packed for one host copy; named on CUDA (--custom-ops greedy_sample=triton) and giving the
engine the same greedy tokens as native."""

from __future__ import annotations

import pytest
import torch

from backplane import Engine, SamplingParams
from backplane.ops import native
from backplane.plugins.ops_triton import ops
from backplane.scheduler.overlap import packed_span

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def randn(*shape, seed=0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed + sum(shape))
    return torch.randn(*shape, generator=gen, device="cuda") * 4


@pytest.mark.parametrize("vocab", [1000, 32000, 128256, 151936])
@pytest.mark.parametrize("bs", [1, 7, 160])
def test_against_native(bs, vocab):
    logits = randn(bs, vocab)
    logits[0, [vocab // 3, vocab - 1]] = 100.0  # a tie across blocks: the first index
    tokens, logprobs = ops.greedy_sample(logits)
    want_tokens, want_logprobs = native.greedy_sample(logits)
    assert tokens.tolist() == want_tokens.tolist() and tokens[0] == vocab // 3
    torch.testing.assert_close(logprobs, want_logprobs, rtol=1e-5, atol=1e-5)
    assert packed_span(tokens, logprobs) is not None


def test_rows_of_a_wider_buffer():
    """The logits processor may hand rows [:bs] of a preallocated [max_bs, vocab] buffer."""
    wide = randn(16, 32000, seed=1)
    tokens, logprobs = ops.greedy_sample(wide[:5])
    want = native.greedy_sample(wide[:5])
    assert torch.equal(tokens, want[0])
    torch.testing.assert_close(logprobs, want[1], rtol=1e-5, atol=1e-5)


def _generate(**kw):
    engine = Engine("tiny-llama", device="cuda", dtype="float32", max_total_tokens=20000,
                    max_running_requests=16, cuda_graph_max_bs=16, **kw)
    prompts = [[5 + i, 7, 9 + 2 * i] * (i + 1) for i in range(12)]
    params = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    return engine, engine.generate(input_ids=prompts, sampling_params=params)


def test_named_triton_equals_native():
    """Named only on CUDA (ops_triton's docstring): auto keeps native; --custom-ops greedy_sample=triton
    runs the kernel, with native's tokens."""
    engine, got = _generate(custom_ops=["greedy_sample=triton"])
    assert engine.backends["custom_ops"]["greedy_sample"] == "triton"
    assert engine.scheduler.launcher.greedy_sample is ops.greedy_sample
    native_engine, want = _generate()
    assert native_engine.backends["custom_ops"]["greedy_sample"] == "native"
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
