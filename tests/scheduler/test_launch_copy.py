"""LaunchedStep's copy to the host: tokens and logprobs packed in one device buffer (as the Triton
`greedy_sample` returns them) go in one copy, anything else in one copy each, with the same host
values. The span logic runs on CPU tensors; the launch itself on a GPU (marker gpu)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from backplane.scheduler.overlap import LaunchedStep, copy_to_host, packed_span


class CountCopies(TorchDispatchMode):
    """Counts the aten copy_ calls run inside the block."""

    def __init__(self):
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            self.copies += 1
        return func(*args, **(kwargs or {}))


def packed(bs, device="cpu", logprob_dtype=torch.float32):
    """tokens [bs] int64 and logprobs [bs] as views of one buffer, logprobs 16-byte aligned after tokens."""
    start = -(-8 * bs // 16) * 16
    buf = torch.zeros(start + bs * torch.finfo(logprob_dtype).bits // 8, dtype=torch.uint8, device=device)
    tokens, logprobs = buf[:8 * bs].view(torch.int64), buf[start:].view(logprob_dtype)
    tokens.copy_(torch.arange(bs) * 1000 + 7)
    logprobs.copy_(-torch.arange(bs, dtype=logprob_dtype) / 8)
    return tokens, logprobs


@pytest.mark.parametrize("bs", [1, 7])
def test_packed_views_make_one_span(bs):
    tokens, logprobs = packed(bs)
    span = packed_span(tokens, logprobs)
    start = 16 if bs == 1 else 64
    assert span is not None and span.dtype == torch.uint8 and span.numel() == start + 4 * bs
    assert span.data_ptr() == tokens.data_ptr()
    assert torch.equal(span[:8 * bs].view(torch.int64), tokens)
    assert torch.equal(span[start:].view(torch.float32), logprobs)


def test_anything_else_is_not_a_span():
    tokens, logprobs = packed(4)
    buf = torch.zeros(8 * 4 + 16 + 16, dtype=torch.uint8)
    assert packed_span(tokens.clone(), logprobs.clone()) is None  # two storages
    assert packed_span(tokens[1:], logprobs[1:]) is None  # logprobs not right after tokens
    assert packed_span(buf[:32].view(torch.int64), buf[48:].view(torch.float32)) is None  # a gap
    assert packed_span(logprobs, tokens) is None  # the other order
    assert packed_span(tokens[::2], logprobs[:2]) is None  # strided
    assert packed_span(tokens[:0], logprobs[:0]) is None
    # an odd count: the logprobs start at the next 16-byte boundary (8 int64 tokens: right after them)
    odd = torch.zeros(64, dtype=torch.uint8)
    assert packed_span(odd[:24].view(torch.int64), odd[24:36].view(torch.float32)) is None
    assert packed_span(odd[:24].view(torch.int64), odd[32:44].view(torch.float32)) is not None
    assert packed_span(odd[:32].view(torch.int64), odd[32:48].view(torch.float32)) is not None


@pytest.mark.parametrize("bs", [1, 7])
def test_packed_results_take_one_copy_and_others_two(bs):
    tokens, logprobs = packed(bs)
    with CountCopies() as one:
        host_tokens, host_logprobs = copy_to_host(tokens, logprobs, pin_memory=False)
    assert one.copies == 1
    assert torch.equal(host_tokens, tokens) and torch.equal(host_logprobs, logprobs)
    assert host_tokens.data_ptr() != tokens.data_ptr()
    with CountCopies() as two:
        host_tokens, host_logprobs = copy_to_host(tokens.clone(), logprobs.clone(), pin_memory=False)
    assert two.copies == 2
    assert torch.equal(host_tokens, tokens) and torch.equal(host_logprobs, logprobs)


def test_cpu_launch_reads_at_once():
    step = LaunchedStep.launch(["a", "b"], *packed(2))
    assert step.new_tokens() == [([7], [0.0]), ([1007], [-0.125])]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("logprob_dtype", [torch.float32, torch.bfloat16])
def test_cuda_launch_copies_packed_results_once(logprob_dtype):
    tokens, logprobs = packed(5, "cuda", logprob_dtype)
    with CountCopies() as one:
        step = LaunchedStep.launch(list("abcde"), tokens, logprobs)
    assert one.copies == 1 and step.tokens.is_pinned()
    expected = [([t], [lp]) for t, lp in zip(tokens.tolist(), logprobs.tolist())]
    assert step.new_tokens() == expected
    with CountCopies() as two:
        step = LaunchedStep.launch(list("abcde"), tokens.clone(), logprobs.clone())
    assert two.copies == 2 and step.new_tokens() == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_triton_greedy_sample_launches_in_one_copy():
    from backplane.plugins.ops_triton import ops

    logits = torch.randn(7, 128256, device="cuda")
    tokens, logprobs = ops.greedy_sample(logits)
    with CountCopies() as one:
        step = LaunchedStep.launch(list("abcdefg"), tokens, logprobs)
    assert one.copies == 1
    got = step.new_tokens()
    assert [t for (t,), _ in got] == logits.argmax(-1).tolist()
    want = torch.log_softmax(logits, -1).gather(1, logits.argmax(-1, keepdim=True)).squeeze(1).tolist()
    assert [lp for _, (lp,) in got] == pytest.approx(want, abs=1e-5)
