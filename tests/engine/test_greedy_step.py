"""An all-greedy engine step on CPU samples through the runner's `greedy_sample` op (native here) and
gives the tokens and log-probabilities of the sampler's formula before the op existed, bit for bit:
every step's logits are recorded and the old formula is applied to them here."""

from __future__ import annotations

import torch

from backplane import Engine, SamplingParams
from backplane.ops.native import greedy_sample
from backplane.scheduler.overlap import LaunchedStep

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [20]]


def old_greedy(logits):
    """The sampler's all-greedy formula before the op (commit abc8fff)."""
    logprobs = torch.log_softmax(logits, dim=-1)
    greedy = logits.argmax(dim=-1)
    return greedy, logprobs.gather(1, greedy.unsqueeze(1)).squeeze(1)


def test_all_greedy_steps_equal_the_old_formula(monkeypatch):
    engine = Engine("tiny-llama", device="cpu", max_total_tokens=1024, max_running_requests=4)
    assert engine.scheduler.launcher.greedy_sample is greedy_sample  # the CPU table's op
    logits_seen, launched = [], []
    forward, launch = engine.runner.forward, LaunchedStep.launch

    def recording_forward(batch, **kwargs):
        out = forward(batch, **kwargs)
        logits_seen.append(out.logits.clone())
        return out

    def recording_launch(reqs, tokens, logprobs):
        launched.append((tokens.clone(), logprobs.clone()))
        return launch(reqs, tokens, logprobs)

    monkeypatch.setattr(engine.runner, "forward", recording_forward)
    monkeypatch.setattr(LaunchedStep, "launch", staticmethod(recording_launch))
    params = [SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)] * len(PROMPTS)
    outs = engine.generate(input_ids=PROMPTS, sampling_params=params)
    assert len(launched) == len(logits_seen) >= 4  # a prefill, then decode steps; every prompt done at once
    for logits, (tokens, logprobs) in zip(logits_seen, launched):
        want_tokens, want_logprobs = old_greedy(logits)
        assert torch.equal(tokens, want_tokens) and torch.equal(logprobs, want_logprobs)
    # what the requests received is what was launched
    per_req = [[] for _ in PROMPTS]
    for tokens, logprobs in launched:
        for i, (t, lp) in enumerate(zip(tokens.tolist(), logprobs.tolist())):
            per_req[i].append((t, lp))
    assert [list(zip(out.token_ids, out.logprobs)) for out in outs] == per_req
