"""The decode step's host shortcuts keep the scheduler's behaviour.

A plain decode step's tokens are read as two flat lists (`OneEach`) and appended one per request
(`append_token`, which runs `check_stop` only when a stop condition may hold); readiness is computed
once per step; a request leaves a queue by identity. Each is checked against the plain rule it
replaces: the old loop (append, then `check_stop`, for every token), `==` on the pairs, and the
outputs of the same requests with and without overlap.
"""

from __future__ import annotations

import random

import pytest

from backplane import Engine, SamplingParams
from backplane.scheduler.overlap import OneEach, _one_each
from backplane.scheduler.queues import RequestQueues
from backplane.scheduler.request import FinishReason, Req
from backplane.scheduler.scheduler import Scheduler
from backplane.scheduler.stopping import append_token, check_stop


def letters(ids: list[int]) -> str:
    """A detokenizer whose tokens are letters: short stop strings occur often."""
    return "".join(chr(ord("a") + t % 6) for t in ids)


class FinishLog:
    """Stands in for RequestQueues in `Scheduler._advance`: records which requests finished."""

    def __init__(self):
        self.finished = []

    def finish(self, req: Req) -> None:
        self.finished.append(req.rid)
        req.row = None


def bare_scheduler(eos: set[int]) -> Scheduler:
    sched = Scheduler.__new__(Scheduler)
    sched._ahead, sched.eos_token_ids, sched.detokenize, sched.queues = {}, eos, letters, FinishLog()
    return sched


def random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(max_new_tokens=rng.randrange(1, 9), temperature=0.0, ignore_eos=rng.random() < 0.3,
                          stop_token_ids=rng.sample(range(12), rng.randrange(0, 2)),
                          stop=rng.sample(["ab", "cc", "fed", "b"], rng.randrange(0, 2)))


def reference_advance(reqs, tokens, logprobs, ahead, eos, finished_log):
    """`Scheduler._advance` as it was: per request its pair of lists, append and check every token."""
    finished = []
    for req, (toks, lps) in zip(reqs, zip(([t] for t in tokens), ([lp] for lp in logprobs))):
        was_ahead = ahead.pop(req.rid, None) is not None
        if req.finished or (req.row is None and not was_ahead):
            continue
        if req.first_token_at is None and toks:
            req.first_token_at = 0.0
        stopped = False
        for t, lp in zip(toks, lps):
            req.output_ids.append(t)
            req.logprobs.append(lp)
            if check_stop(req, eos, letters):
                stopped = True
                break
        if stopped or was_ahead:
            req.finished_at = 0.0
            if not was_ahead:
                finished_log.append(req.rid)
                req.row = None
            finished.append(req)
    return finished


def state(reqs):
    return [(r.rid, r.output_ids, r.logprobs, r.finish_reason, r.text, r.row, r.first_token_at is not None,
             r.finished_at is not None) for r in reqs]


@pytest.mark.parametrize("seed", range(6))
def test_advance_of_a_plain_decode_step_equals_the_per_token_rule(seed):
    rng = random.Random(seed)
    eos = {0, 7}
    params = [random_params(rng) for _ in range(40)]
    fast = [Req(i, [1, 2], p, row=i + 1) for i, p in enumerate(params)]
    slow = [Req(i, [1, 2], p, row=i + 1) for i, p in enumerate(params)]
    sched, slow_log = bare_scheduler(eos), []
    for step in range(10):
        tokens = [rng.randrange(12) for _ in fast]
        logprobs = [-rng.random() for _ in fast]
        for i in rng.sample(range(len(fast)), 2):  # aborted, or finished ahead, after the launch
            if rng.random() < 0.5:
                for r in (fast[i], slow[i]):
                    if r.finish_reason is None:
                        r.abort("test")
            elif fast[i].row is not None and fast[i].finish_reason is None:
                fast[i].row = slow[i].row = None
                sched._ahead[i] = fast[i]
        slow_ahead = {rid: slow[rid] for rid in sched._ahead}
        got = sched._advance(fast, _one_each(tokens, logprobs))
        want = reference_advance(slow, tokens, logprobs, slow_ahead, eos, slow_log)
        assert [r.rid for r in got] == [r.rid for r in want], f"step {step}"
        assert state(fast) == state(slow), f"step {step}"
        assert sched.queues.finished == slow_log and not sched._ahead
    reasons = {r.finish_reason for r in fast}
    assert {FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT} <= reasons  # every way out was taken
    assert any(r.text is not None for r in fast)  # and a stop string cut a text


def test_append_token_stops_exactly_where_check_stop_does():
    rng = random.Random(3)
    for _ in range(300):
        p = random_params(rng)
        a, b = Req(0, [5], p), Req(0, [5], p)
        if rng.random() < 0.1:  # appending to a finished request reports it stopped, as check_stop does
            a.finish_reason = b.finish_reason = FinishReason.ABORT
        for _ in range(10):
            t, lp = rng.randrange(12), -rng.random()
            b.output_ids.append(t)
            b.logprobs.append(lp)
            assert append_token(a, t, lp, {0}, letters) == check_stop(b, {0}, letters)
            assert (a.output_ids, a.finish_reason, a.text) == (b.output_ids, b.finish_reason, b.text)
            if a.finish_reason is not None:
                break


def test_one_each_reads_as_its_pairs():
    got = _one_each([7, 8, 9], [-0.5, -1.0, -2.0])
    pairs = [([7], [-0.5]), ([8], [-1.0]), ([9], [-2.0])]
    assert isinstance(got, OneEach) and len(got) == 3
    assert got == pairs and pairs == got and list(got) == pairs
    assert got[1] == ([8], [-1.0]) and got[-1] == ([9], [-2.0]) and got[1:] == pairs[1:]
    assert got != pairs[:2] and got != [([7], [-0.5]), ([8], [-1.0]), ([9], [-2.5])]


def test_a_request_leaves_the_queues_by_identity():
    class Pool:
        def alloc(self):
            return 1

        def free(self, row):
            pass

    class Cache:
        def admit(self, req):
            pass

        def release(self, req, keep):
            pass

    queues = RequestQueues(Pool(), Cache())
    twins = [Req(1, [1], SamplingParams(), created_at=0.0) for _ in range(2)]
    assert twins[0] == twins[1]  # equal field by field: only identity tells them apart
    others = [Req(i, [1], SamplingParams()) for i in range(2, 6)]
    queues.running = [others[0], twins[0], others[1], twins[1], others[2]]
    queues.finish(twins[1])
    assert [id(r) for r in queues.running] == [id(r) for r in (others[0], twins[0], others[1], others[2])]
    queues.preempt(others[1])
    assert queues.waiting[0] is others[1] and len(queues.running) == 3
    queues.waiting.extend([twins[1], others[3]])
    queues.abort(others[3], "gone")
    assert list(map(id, queues.waiting)) == [id(others[1]), id(twins[1])] and others[3].error == "gone"
    queues.admit([twins[1]])
    assert list(queues.waiting) == [others[1]] and queues.running[-1] is twins[1]


# -- end to end -------------------------------------------------------------------------------------

ENGINE = dict(model="tiny-llama", device="cpu", max_total_tokens=4096, max_running_requests=32)


@pytest.fixture(scope="module")
def engines():
    return {overlap: Engine(**ENGINE, disable_overlap_schedule=not overlap) for overlap in (True, False)}


def mixed_requests(engine: Engine, n: int = 24):
    """Prompts, and parameters that stop them every way: a stop string and a stop token taken from
    an unbounded run's output (so they occur, steps after the first), max_new_tokens, ignore_eos."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(3, 12))] for _ in range(n)]
    free = engine.generate(input_ids=prompts, sampling_params=SamplingParams(max_new_tokens=24, temperature=0.0,
                                                                             ignore_eos=True))
    params = []
    for i, out in enumerate(free):
        kind = i % 4
        if kind == 0:  # a stop string ending in the output's middle
            text = out.text
            params.append(SamplingParams(max_new_tokens=24, temperature=0.0, stop=[text[len(text) // 2:][:3] or "x"]))
        elif kind == 1:
            params.append(SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=[out.token_ids[9]]))
        elif kind == 2:
            params.append(SamplingParams(max_new_tokens=rng.randrange(1, 20), temperature=0.0, ignore_eos=True))
        else:
            params.append(SamplingParams(max_new_tokens=rng.randrange(1, 20), temperature=0.0))
    return prompts, params


def replayed(engine: Engine, out, params: SamplingParams):
    """Where the plain rule (check_stop after every token) stops the output's tokens: (kept, reason, text)."""
    req = Req(0, [1], params)
    sched = engine.scheduler
    for t in out.token_ids:
        req.output_ids.append(t)
        if check_stop(req, sched.eos_token_ids, sched.detokenize):
            break
    text = req.text if req.text is not None else sched.detokenize(req.output_ids)
    return req.output_ids, req.finish_reason.value if req.finish_reason else None, text


def test_engine_outputs_stop_where_the_per_token_rule_does(engines):
    prompts, params = mixed_requests(engines[True])
    runs = {o: e.generate(input_ids=prompts, sampling_params=params) for o, e in engines.items()}
    for a, b in zip(runs[True], runs[False]):  # NOTE: batches differ in float rounding with and without overlap
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4) and len(a.logprobs) == len(a.token_ids)
    for out, p in zip(runs[True], params):
        assert replayed(engines[True], out, p) == (out.token_ids, out.finish_reason, out.text)
    assert {o.finish_reason for o in runs[True]} == {"stop", "length"}
    assert any(p.stop and o.finish_reason == "stop" and o.text != engines[True].decode(o.token_ids)
               for o, p in zip(runs[True], params))  # a stop string cut a text


@pytest.mark.parametrize("overlap", [True, False])
def test_an_abort_mid_run_leaves_the_other_requests_as_they_were(engines, overlap):
    engine = engines[overlap]
    prompts, params = mixed_requests(engine)
    whole = engine.generate(input_ids=prompts, sampling_params=params)
    victim = max(range(len(prompts)), key=lambda i: len(whole[i].token_ids))  # runs the longest
    steps = []

    def abort_at_step_4(finished):
        steps.append(finished)
        if len(steps) == 4:
            req = next(r for r in engine.scheduler.running if r.prompt_ids == prompts[victim])
            engine.scheduler.abort(req, "aborted by the test")

    cut = engine.generate(input_ids=prompts, sampling_params=params, progress=abort_at_step_4)
    assert cut[victim].finish_reason == "abort" and cut[victim].error == "aborted by the test"
    assert whole[victim].token_ids[:len(cut[victim].token_ids)] == cut[victim].token_ids
    assert len(cut[victim].token_ids) < len(whole[victim].token_ids)
    for i, (a, b) in enumerate(zip(whole, cut)):
        if i != victim:
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
