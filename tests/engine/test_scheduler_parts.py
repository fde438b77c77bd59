"""The scheduler's parts on their own, over real CPU pools and no model: admission (`refusal`,
`PrefillAdder`, `admit_prefill`, `ready_for_decode`), `RequestQueues` (admission, preemption, rollback), `append_tokens`,
and the Scheduler's attributes that its parts own."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from backplane.config import SchedulerConfig
from backplane.contracts.memory import ReqToTokenPool, TokenToKVPool
from backplane.scheduler import SamplingParams, Scheduler
from backplane.scheduler.admission import PrefillAdder, admit_prefill, ready_for_decode, refusal
from backplane.scheduler.overlap import LaunchedStep
from backplane.scheduler.prefix_cache import PrefixCache
from backplane.scheduler.queues import RequestQueues
from backplane.scheduler.request import FinishReason, Req
from backplane.scheduler.stopping import append_tokens

PARAMS = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)


def make_cache(num_slots: int = 32, rows: int = 5) -> PrefixCache:
    return PrefixCache(TokenToKVPool(num_slots, 1, 1, 2, torch.float32, "cpu"), ReqToTokenPool(rows, 64, "cpu"),
                       enabled=False)


def waiting(rid: int, length: int, lora: str | None = None) -> Req:
    return Req(rid, list(range(1, length + 1)), PARAMS, lora=lora)


def decoding(rid: int, row: int) -> Req:
    """A running request past its prompt: its next step is a decode step."""
    return Req(rid, [1, 2], PARAMS, output_ids=[3], row=row, num_cached=2)


def adder(cache: PrefixCache, running=(), participants=(), *, budget=16, max_running=3, slots=1, isolated=()):
    return PrefillAdder(cache, list(running), list(participants), token_budget=budget, max_running=max_running,
                        decode_slots_per_request=slots, isolated=set(isolated))


@pytest.mark.parametrize("req, fragment", [
    (Req(0, [], PARAMS), "request 0: empty prompt; expected at least one token"),
    (Req(1, [1] * 61, PARAMS), "request 1: prompt of 61 tokens + max_new_tokens 4 exceeds the context length 64"),
    (Req(2, [1] * 40, PARAMS), "request 2: prompt of 40 tokens + max_new_tokens 4 needs 47 KV slots but the pool holds 46"),
    (Req(3, [1, 7, 100], PARAMS), "request 3: token id 100 is outside the vocabulary; expected ids in [0, 100)"),
    (Req(4, [0, 99, 5], PARAMS), None),
])
def test_refusal_names_the_request_and_the_limit(req, fragment):
    found = refusal(req, context_len=64, num_kv_slots=46, spare_slots=3, vocab_size=100)
    if fragment is None:
        assert found is None
    else:
        assert fragment in found


def test_a_long_prompt_takes_what_the_token_budget_leaves_and_then_the_batch_is_full():
    a = adder(make_cache(), budget=16)
    assert a.add(waiting(0, 10)) and a.add(waiting(1, 10))
    assert not a.add(waiting(2, 1))  # budget spent
    assert ([r.rid for r in a.reqs], a.chunks) == ([0, 1], [10, 6])


def test_new_requests_stop_at_the_running_limit_but_running_prompts_continue():
    cache = make_cache()
    mid_prompt = Req(9, list(range(1, 21)), PARAMS, row=0, num_cached=4)
    a = adder(cache, [decoding(7, 1), mid_prompt], budget=20, max_running=3)
    assert a.add(mid_prompt) and a.add(waiting(0, 3))
    assert not a.may_admit() and not a.add(waiting(1, 3))
    assert ([r.rid for r in a.reqs], a.chunks, [r.rid for r in a.new]) == ([9, 0], [16, 3], [0])


def test_the_kv_room_keeps_each_decoding_request_its_next_step():
    cache = make_cache(num_slots=12)
    running = [decoding(7, 0), decoding(8, 1)]
    assert not adder(cache, running, slots=3).add(waiting(0, 7))  # 12 - 2 * 3 leaves 6 slots
    a = adder(cache, running, slots=3)
    assert a.add(waiting(1, 6)) and a.chunks == [6]


def test_a_participant_refusal_ends_the_batch_and_sees_the_batch_mates():
    seen = []

    class OneAdapter:
        def can_admit(self, req, batch_mates):
            seen.append((req.rid, [r.rid for r in batch_mates]))
            return all(r.lora == req.lora for r in batch_mates)

    a = adder(make_cache(), [decoding(7, 0)], [OneAdapter()])
    a.running[0].lora = "x"
    assert a.add(waiting(0, 3, lora="x"))
    refused = waiting(1, 3, lora="y")
    assert not a.add(refused)
    assert [r.rid for r in a.reqs] == [0] and refused.num_cached == 0
    assert seen[:2] == [(0, [7]), (1, [7, 0])]


def test_an_isolated_request_only_starts_an_empty_batch_and_runs_alone():
    late = adder(make_cache(), isolated={1})
    assert late.add(waiting(0, 3)) and not late.add(waiting(1, 3))
    assert [r.rid for r in late.reqs] == [0]
    first = adder(make_cache(), isolated={1})
    assert not first.add(waiting(1, 3))  # added, and nothing may follow it
    assert [r.rid for r in first.reqs] == [1]


def test_admit_prefill_continues_running_prompts_first_and_gives_new_requests_a_row():
    cache = make_cache()
    queues = RequestQueues(cache.req_pool, cache)
    mid_prompt = Req(9, list(range(1, 11)), PARAMS, row=cache.req_pool.alloc(), num_cached=6)
    queues.running.append(mid_prompt)
    queues.waiting.extend([waiting(0, 5), waiting(1, 5)])
    reqs, chunks = admit_prefill(queues, [], token_budget=8, max_running=3, decode_slots_per_request=1)
    assert ([r.rid for r in reqs], chunks) == ([9, 0], [4, 4])
    assert queues.running == [mid_prompt, reqs[1]] and reqs[1].row is not None
    assert [r.rid for r in queues.waiting] == [1]
    full = RequestQueues(cache.req_pool, cache)
    full.waiting.append(waiting(2, 3))
    assert admit_prefill(full, [], token_budget=8, max_running=0, decode_slots_per_request=1) is None
    assert list(full.waiting) and not full.running

def test_ready_for_decode_leaves_out_a_request_whose_last_token_is_in_flight():
    last, more, prefilling = decoding(0, 0), decoding(1, 1), Req(2, [1, 2, 3], PARAMS, row=2, num_cached=1)
    last.output_ids, last.num_cached = [3, 3, 3], 4  # its in-flight token is the 4th and last
    assert ready_for_decode([last, more, prefilling], None) == [last, more]
    in_flight = LaunchedStep.known_tokens([last, more], [([5], [0.0]), ([5], [0.0])])
    assert ready_for_decode([last, more, prefilling], in_flight) == [more]


def running_queues(num: int) -> tuple[RequestQueues, list[Req]]:
    cache = make_cache()
    queues = RequestQueues(cache.req_pool, cache)
    reqs = [waiting(i, 3) for i in range(num)]
    queues.waiting.extend(reqs)
    queues.admit(reqs)
    for req in reqs:
        req.slots, req.num_cached = [cache.kv_pool.alloc(3)], 3
    return queues, reqs


def test_admit_gives_rows_and_preempt_puts_the_request_first_in_line():
    queues, (a, b) = running_queues(2)
    pool = queues.prefix_cache.kv_pool
    assert queues.running == [a, b] and not queues.waiting and {a.row, b.row} <= set(range(5))
    free = pool.num_free
    queues.waiting.append(waiting(5, 2))
    queues.preempt(b)
    assert (b.row, b.slots, b.num_cached, pool.num_free) == (None, [], 0, free + 3)
    assert queues.running == [a] and [r.rid for r in queues.waiting] == [1, 5]


def test_roll_back_preempts_a_failed_batch_into_isolation_then_aborts_the_lone_culprit():
    queues, (a, b, c) = running_queues(3)
    assert queues.roll_back([a, b], "boom") == []
    assert queues.running == [c] and list(queues.waiting) == [a, b] and queues.isolated == {0, 1}
    queues.admit([a])
    assert queues.roll_back([a], "boom again") == [a]
    assert (a.finish_reason, a.error, a.row) == (FinishReason.ABORT, "boom again", None)
    assert queues.isolated == {1} and queues.running == [c] and list(queues.waiting) == [b]


def test_roll_back_without_a_running_batch_aborts_everyone():
    queues, (a, b) = running_queues(2)
    queues.waiting.append(waiting(5, 2))
    gone = queues.roll_back([], "scheduling failed")
    assert [r.rid for r in gone] == [0, 1, 5] and not queues.running and not queues.waiting
    assert all(r.error == "scheduling failed" for r in gone)
    assert queues.req_pool.num_free == 5 and queues.prefix_cache.kv_pool.num_free == 32


def test_append_tokens_stops_at_a_stop_token_and_drops_the_tokens_after_it():
    req = Req(0, [1], SamplingParams(max_new_tokens=10, stop_token_ids=[7]))
    assert not append_tokens(req, [4, 5], [-0.1, -0.2], set(), str)
    assert append_tokens(req, [6, 7, 8], [-0.3, -0.4, -0.5], set(), str)
    assert (req.output_ids, req.logprobs, req.finish_reason) == ([4, 5, 6, 7], [-0.1, -0.2, -0.3, -0.4], FinishReason.STOP)


def test_the_scheduler_reads_and_sets_what_its_parts_own():
    cache = make_cache()
    runner = SimpleNamespace(req_to_token_pool=cache.req_pool, token_to_kv_pool=cache.kv_pool,
                             device=torch.device("cpu"), context_len=64)
    sched = Scheduler(runner, SchedulerConfig(max_running=3, chunk_size=8), eos_token_ids=set(), detokenize=str,
                      prefix_cache=cache)
    assert sched.running is sched.queues.running and sched.waiting is sched.queues.waiting
    assert sched.prefix_cache is cache and sched.decode_state is sched.launcher.decode_state
    spy = object()
    sched.participants = [spy]
    assert sched.launcher.participants == [spy]
    sched.add(Req(0, [], PARAMS))
    sched.add(waiting(1, 3))
    assert [r.rid for r in sched.waiting] == [1] and sched.has_work
