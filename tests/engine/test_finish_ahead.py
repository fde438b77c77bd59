"""Finishing ahead: a request whose token in flight is certainly its last gives its KV and row back
while the device computes that token (`Scheduler._finish_ahead`), not after the token is read.

Checked here on CPU: when it happens (before the read, only for such requests), that outputs and
pools are what the plain order gives, that the prefix cache keeps the prompt, and that a step whose
tokens cannot be read aborts the requests finished ahead and loses nothing else.
"""

from __future__ import annotations

import random

import pytest

from backplane import Engine, SamplingParams
from backplane.scheduler.overlap import LaunchedStep
from backplane.scheduler.queues import RequestQueues
from backplane.scheduler.scheduler import Scheduler
from helpers_models import unused_slots

TINY = dict(device="cpu", max_total_tokens=2048, max_running_requests=8)


def prompts_of(lengths, seed=0, vocab=500):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def greedy(n, **kw):
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture
def events(monkeypatch):
    """("finish", rid) whenever a request's KV and row go back, ("read", rids) whenever a step's
    tokens are read, in order."""
    log = []
    finish, read = RequestQueues.finish, LaunchedStep.new_tokens

    def spy_finish(self, req):
        log.append(("finish", req.rid))
        return finish(self, req)

    def spy_read(self):
        log.append(("read", tuple(r.rid for r in self.reqs)))
        return read(self)

    monkeypatch.setattr(RequestQueues, "finish", spy_finish)
    monkeypatch.setattr(LaunchedStep, "new_tokens", spy_read)
    return log


def finish_vs_read(log, rid):
    """(index of the request's finish, index of the read of its last token) in the log."""
    reads = [i for i, (kind, what) in enumerate(log) if kind == "read" and rid in what]
    return log.index(("finish", rid)), reads[-1]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_one_token_request_finishes_before_its_token_is_read(events, overlap):
    engine = Engine("tiny-llama", disable_overlap_schedule=not overlap, **TINY)
    out = engine.generate(input_ids=prompts_of([40]), sampling_params=greedy(1))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 1
    rid = next(what for kind, what in events if kind == "finish")
    finish, read = finish_vs_read(events, rid)
    assert finish < read, events


def test_last_decode_step_finishes_ahead_only_when_its_input_is_on_the_host(events):
    """Without overlap a request's last decode step has its input token on the host: it finishes
    ahead. Under overlap that input is still in flight: it finishes after the read, as before."""
    for overlap, ahead in ((False, True), (True, False)):
        events.clear()
        engine = Engine("tiny-llama", disable_overlap_schedule=not overlap, **TINY)
        engine.generate(input_ids=prompts_of([9]), sampling_params=greedy(4))
        rid = next(what for kind, what in events if kind == "finish")
        finish, read = finish_vs_read(events, rid)
        assert (finish < read) is ahead, (overlap, events)


def test_outputs_and_pools_equal_the_plain_order(monkeypatch):
    prompts = prompts_of([3, 30, 1, 12, 57, 9, 20])
    base = Engine("tiny-llama", **TINY).generate(input_ids=prompts, sampling_params=greedy(8))
    params = [greedy(n) for n in (1, 8, 1, 2, 5, 1, 3)]
    params[1] = greedy(8, stop_token_ids=[base[1].token_ids[2]])  # stops on a token before its length
    outs = {}
    for ahead in (True, False):
        if not ahead:
            monkeypatch.setattr(Scheduler, "_finish_ahead", lambda self, reqs: None)
        for overlap in (True, False):
            engine = Engine("tiny-llama", disable_overlap_schedule=not overlap, **TINY)
            start = (unused_slots(engine), engine.runner.req_to_token_pool.num_free)
            outs[(ahead, overlap)] = engine.generate(input_ids=prompts, sampling_params=params)
            assert (unused_slots(engine), engine.runner.req_to_token_pool.num_free) == start
            assert not engine.scheduler.has_work and not engine.scheduler._ahead
    reference = outs[(False, False)]
    for key, got in outs.items():
        for i, (x, y) in enumerate(zip(got, reference)):
            assert (x.token_ids, x.finish_reason) == (y.token_ids, y.finish_reason), (key, i)
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5), (key, i)
    assert [len(o.token_ids) for o in reference] == [1, 3, 1, 2, 5, 1, 3]


def test_prefix_cache_keeps_the_prompt_of_a_one_token_request():
    engine = Engine("tiny-llama", **TINY)
    prompt = prompts_of([64], seed=3)
    first = engine.generate(input_ids=prompt, sampling_params=greedy(1))[0]
    before = engine.stats()["prefix_cache"]["prefill_tokens"]
    again = engine.generate(input_ids=prompt, sampling_params=greedy(1))[0]
    assert engine.stats()["prefix_cache"]["prefill_tokens"] - before == 1  # all but the last token cached
    assert again.token_ids == first.token_ids


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_a_step_that_cannot_be_read_aborts_the_requests_finished_ahead(monkeypatch, overlap):
    """The step of a one-token request fails when its tokens are read: the request (already finished
    ahead) is aborted with the error, the pools are whole, and the engine serves the next call."""
    engine = Engine("tiny-llama", disable_overlap_schedule=not overlap, **TINY)
    prompts = prompts_of([17, 5], seed=4)
    reference = engine.generate(input_ids=prompts, sampling_params=greedy(1))
    engine.flush_cache()
    start = (unused_slots(engine), engine.runner.req_to_token_pool.num_free)
    read = LaunchedStep.new_tokens

    def failing(self):
        if any(r.params.max_new_tokens == 1 for r in self.reqs):
            raise RuntimeError("device lost the tokens")
        return read(self)

    monkeypatch.setattr(LaunchedStep, "new_tokens", failing)
    outs = engine.generate(input_ids=prompts, sampling_params=[greedy(1), greedy(1)])
    assert all(o.finish_reason == "abort" and "device lost the tokens" in o.error for o in outs), outs
    assert not engine.scheduler._ahead and not engine.scheduler.has_work
    assert (unused_slots(engine), engine.runner.req_to_token_pool.num_free) == start
    monkeypatch.setattr(LaunchedStep, "new_tokens", read)
    again = engine.generate(input_ids=prompts, sampling_params=greedy(1))
    assert [o.token_ids for o in again] == [o.token_ids for o in reference]
