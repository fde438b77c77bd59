"""The Triton `greedy_sample` kernel under TRITON_INTERPRET=1 against the native op (fp32 logits):
the first maximal index and its log-softmax, both in one packed buffer."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere: run kernels on CPU

import pytest  # noqa: E402
import torch  # noqa: E402

from backplane.ops import native  # noqa: E402
from backplane.plugins.ops_triton import kernels, ops  # noqa: E402
from backplane.scheduler.overlap import packed_span  # noqa: E402

INF = float("inf")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy under the interpreter: the +inf row


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed + sum(shape))) * 4


def reference(logits):
    """The sampler's all-greedy formula before the op existed, written out here."""
    tokens = logits.argmax(dim=-1)
    return tokens, torch.log_softmax(logits, dim=-1)[torch.arange(len(tokens)), tokens]


def check(logits):
    tokens, logprobs = ops.greedy_sample(logits)
    want_tokens, want_logprobs = reference(logits)
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert tokens.tolist() == want_tokens.tolist()
    torch.testing.assert_close(logprobs, want_logprobs, rtol=1e-5, atol=1e-5, equal_nan=True)
    return tokens, logprobs


@pytest.fixture
def small_block(monkeypatch):
    """Blocks of 64 logits: a row of a few hundred takes several loop steps and a ragged last one."""
    monkeypatch.setattr(kernels, "GREEDY_BLOCK", 64)


@pytest.mark.parametrize("bs", [1, 7])
@pytest.mark.parametrize("vocab", [1, 5, 64, 300, 1000])
def test_random_rows(bs, vocab, small_block):
    check(randn(bs, vocab))


@pytest.mark.parametrize("bs", [1, 7])
@pytest.mark.parametrize("vocab", [1000, 8193])
def test_default_block(bs, vocab):
    check(randn(bs, vocab, seed=1))


def test_large_vocab():
    logits = randn(3, 128256, seed=2)
    logits[1, 128255] = 50.0  # the maximum in the last, partly masked block
    logits[2, 0] = 50.0  # in the first
    tokens, _ = check(logits)
    assert tokens[1:].tolist() == [128255, 0]


def test_ties_take_the_first_index(small_block):
    """Equal maxima in the same lane (indices 64 apart), in other lanes, in later blocks: the first wins."""
    logits = randn(5, 300, seed=3)
    peaks = [(0, [70, 6]), (1, [5, 3]), (2, [290, 200, 299]), (3, [64, 128, 0]), (4, [9, 73, 10])]
    for row, cols in peaks:
        logits[row, cols] = 20.0
    tokens, _ = check(logits)
    assert tokens.tolist() == [6, 3, 200, 0, 9]
    flat = torch.zeros(2, 300)  # a constant row: every index ties
    assert check(flat)[0].tolist() == [0, 0]


def test_infinities_and_nan(small_block):
    logits = randn(6, 300, seed=4)
    logits[0, :] = -INF
    logits[0, [150, 250]] = 1.5  # one finite value per far lane, the rest -inf
    logits[1, :] = -INF  # all -inf: index 0, NaN log-probability (as torch)
    logits[2, ::2] = -INF  # half the row masked out
    logits[3, [40, 170]] = INF  # +inf: the first one, NaN log-probability
    logits[4, [100, 230]] = float("nan")  # NaN counts as maximal: the first NaN
    logits[5, 299] = -INF  # the last value, in the ragged block, -inf
    tokens, logprobs = check(logits)
    assert tokens[:5].tolist() == [150, 0, tokens[2].item(), 40, 100]
    assert logprobs[1].isnan() and logprobs[3].isnan() and logprobs[4].isnan()
    assert tokens[2] % 2 == 1 and logprobs[0].item() == pytest.approx(-0.6931472, abs=1e-6)


def test_logprob_is_the_log_softmax_not_a_shifted_value(small_block):
    """A wrong normalizer (one block's sum, no rescaling) would be off by far more than the tolerance."""
    logits = torch.linspace(-3, 3, 500).repeat(2, 1)
    logits[1] = logits[1].flip(0)
    tokens, logprobs = check(logits)
    assert tokens.tolist() == [499, 0]
    assert logprobs[0].item() == pytest.approx(torch.log_softmax(logits[0], 0)[499].item(), abs=1e-6)


def test_results_are_views_of_one_buffer_laid_out_for_the_host():
    for bs, start in ((7, 64), (8, 64), (1, 16)):
        tokens, logprobs = ops.greedy_sample(randn(bs, 100))
        span = packed_span(tokens, logprobs)
        assert span is not None and span.numel() == start + 4 * bs
        assert torch.equal(span[:8 * bs].view(torch.int64), tokens)
        assert torch.equal(span[start:].view(torch.float32), logprobs)


def test_other_inputs_go_to_native():
    """fp64 and a strided row are native's (not packed); an empty row fails as torch.argmax does."""
    for logits in (randn(3, 50).double(), randn(50, 3).t()):
        tokens, logprobs = ops.greedy_sample(logits)
        want = native.greedy_sample(logits)
        assert torch.equal(tokens, want[0]) and torch.equal(logprobs, want[1])
        assert packed_span(tokens, logprobs) is None
    with pytest.raises(IndexError):
        ops.greedy_sample(torch.empty(2, 0))
    assert ops.greedy_sample(torch.empty(0, 10))[0].shape == (0,)
