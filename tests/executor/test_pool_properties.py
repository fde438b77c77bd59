"""Property-based tests: no KV slot or request row leaks or is double-freed under any interleaving
of add, step (prefill, decode, chunked prefill, preemption), finish and abort; with the radix
prefix cache also of insert (after prefill, finish, preemption), match, evict and abort."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from backplane.engine.prefix_cache import PrefixCache
from backplane.scheduler.request import Req
from backplane.scheduler.sampling_params import SamplingParams
from backplane.engine.scheduler import Scheduler
from backplane.contracts.memory import ReqToTokenPool, TokenToKVPool
from backplane.contracts.model import ModelOutput

NUM_SLOTS, NUM_ROWS, VOCAB = 48, 5, 16


class FakeRunner:
    """Pools and a forward that returns random logits: the scheduler's view of a model runner."""

    def __init__(self):
        self.device = torch.device("cpu")
        self.context_len = 64
        self.req_to_token_pool = ReqToTokenPool(NUM_ROWS + 1, self.context_len, "cpu")
        self.token_to_kv_pool = TokenToKVPool(NUM_SLOTS, 1, 1, 2, torch.float32, "cpu")
        self.gen = torch.Generator().manual_seed(0)

    def forward(self, batch):
        n = batch.num_tokens if batch.forward_mode.is_decode else batch.batch_size
        # Every slot a batch writes must be allocated and not the dump slot.
        assert bool((batch.out_cache_loc > 0).all())
        return ModelOutput(torch.randn(n, VOCAB, generator=self.gen))


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.runner = FakeRunner()
        self.scheduler = Scheduler(self.runner, max_running=4, chunk_size=12, eos_token_ids={1},
                                   detokenize=lambda ids: "")
        self.live: list[Req] = []
        self.next_rid = 0

    @rule(prompt_len=st.integers(1, 30), max_new=st.integers(1, 12), temperature=st.sampled_from([0.0, 1.0]))
    def add(self, prompt_len, max_new, temperature):
        req = Req(self.next_rid, [2 + (i % 13) for i in range(prompt_len)],
                  SamplingParams(max_new_tokens=max_new, temperature=temperature))
        self.next_rid += 1
        self.scheduler.add(req)
        if not req.finished:
            self.live.append(req)

    @precondition(lambda self: self.scheduler.has_work)
    @rule()
    def step(self):
        for req in self.scheduler.step():
            self.live.remove(req)

    @precondition(lambda self: bool(self.live))
    @rule(index=st.integers(0, 100))
    def abort(self, index):
        req = self.live.pop(index % len(self.live))
        self.scheduler.abort(req, "aborted by the test")
        assert req.row is None and req.slots == []

    @invariant()
    def slots_are_conserved_and_owned_once(self):
        held = [s for req in self.live for chunk in req.slots for s in chunk.tolist()]
        assert len(held) == len(set(held)), "a KV slot is held by two requests"
        assert 0 not in held, "the dump slot was handed out"
        assert self.runner.token_to_kv_pool.num_free + len(held) == NUM_SLOTS
        rows = [req.row for req in self.live if req.row is not None]
        assert len(rows) == len(set(rows))
        assert self.runner.req_to_token_pool.num_free + len(rows) == NUM_ROWS + 1
        for req in self.live:
            assert sum(c.numel() for c in req.slots) == req.num_cached

    def teardown(self):
        while self.scheduler.has_work:  # draining always finishes: the pools come back whole
            for req in self.scheduler.step():
                self.live.remove(req)
        assert self.runner.token_to_kv_pool.num_free == NUM_SLOTS
        assert self.runner.req_to_token_pool.num_free == NUM_ROWS + 1


SchedulerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                              suppress_health_check=[HealthCheck.too_slow])
test_scheduler_never_leaks_or_double_frees = SchedulerMachine.TestCase

PREFIXES = [[2 + (i % 13) for i in range(20)], [3 + (i % 11) for i in range(14)]]


class CachedSchedulerMachine(SchedulerMachine):
    """The same scheduler over a radix cache; prompts often share one of two prefixes."""

    def __init__(self):
        super().__init__()
        runner = self.runner
        self.cache = PrefixCache(runner.token_to_kv_pool, runner.req_to_token_pool)
        self.scheduler = Scheduler(runner, max_running=4, chunk_size=12, eos_token_ids={1},
                                   detokenize=lambda ids: "", prefix_cache=self.cache)

    @rule(prefix=st.sampled_from([0, 1, None]), prefix_len=st.integers(1, 20), suffix_len=st.integers(1, 8),
          max_new=st.integers(1, 8), adapter=st.sampled_from([None, "a"]))
    def add_shared(self, prefix, prefix_len, suffix_len, max_new, adapter):
        head = PREFIXES[prefix][:prefix_len] if prefix is not None else []
        req = Req(self.next_rid, head + [5 + (self.next_rid + i) % 9 for i in range(suffix_len)],
                  SamplingParams(max_new_tokens=max_new, temperature=0.0), lora=adapter)
        self.next_rid += 1
        self.scheduler.add(req)
        if not req.finished:
            self.live.append(req)

    @rule(num_slots=st.integers(1, 30))
    def evict(self, num_slots):
        before = self.runner.token_to_kv_pool.num_free
        freed = self.cache.tree.evict(num_slots)
        assert self.runner.token_to_kv_pool.num_free == before + freed

    @rule(prefix=st.sampled_from([0, 1]), n=st.integers(0, 20), adapter=st.sampled_from([None, "a"]))
    def match(self, prefix, n, adapter):
        found = self.cache.tree.match(PREFIXES[prefix][:n], adapter)
        assert found.length <= n and set(found.slots.tolist()) <= set(self.cache.tree.all_slots().tolist())

    @invariant()
    def slots_are_conserved_and_owned_once(self):
        pool, tree = self.runner.token_to_kv_pool, self.cache.tree
        cached = tree.all_slots().tolist()
        private = [s for req in self.live for s in (torch.cat(req.slots).tolist() if req.slots else [])[req.num_shared:]]
        free = [s for s in range(1, NUM_SLOTS + 1) if bool(pool._is_free[s])]
        owned = cached + private + free
        assert len(owned) == len(set(owned)), "a KV slot is held twice (tree, a request, the free list)"
        assert 0 not in owned and len(owned) == NUM_SLOTS  # free + cached + in use = total
        assert tree.evictable_size + tree.protected_size == len(cached)
        referenced = {s for n in tree.nodes() if n.lock_ref > 0 for s in n.slots.tolist()}
        assert tree.protected_size == len(referenced)
        for req in self.live:
            assert sum(c.numel() for c in req.slots) == req.num_cached
            shared = (torch.cat(req.slots).tolist() if req.slots else [])[:req.num_shared]
            assert set(shared) <= referenced, "a request's cached prefix is not referenced"
            if req.row is not None and req.num_cached:
                row = self.runner.req_to_token_pool.req_to_token[req.row, :req.num_cached].tolist()
                assert row == torch.cat(req.slots).tolist()

    def teardown(self):
        while self.scheduler.has_work:
            for req in self.scheduler.step():
                self.live.remove(req)
        tree = self.cache.tree
        assert tree.protected_size == 0, "a finished request still references the cache"
        assert self.runner.token_to_kv_pool.num_free + tree.total_size == NUM_SLOTS
        tree.evict(NUM_SLOTS)
        assert self.runner.token_to_kv_pool.num_free == NUM_SLOTS
        assert self.runner.req_to_token_pool.num_free == NUM_ROWS + 1


CachedSchedulerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                                    suppress_health_check=[HealthCheck.too_slow])
test_cached_scheduler_never_leaks_or_double_frees = CachedSchedulerMachine.TestCase


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 9)), max_size=60))
def test_kv_pool_alloc_free_interleavings(ops):
    pool = TokenToKVPool(40, 1, 1, 2, torch.float32, "cpu")
    held: list[torch.Tensor] = []
    for is_alloc, n in ops:
        if is_alloc and n <= pool.num_free:
            held.append(pool.alloc(n))
        elif held:
            pool.free(held.pop(n % len(held)))
        flat = torch.cat(held).tolist() if held else []
        assert len(flat) == len(set(flat)) and 0 not in flat
        assert pool.num_free + len(flat) == 40
    for chunk in held:
        pool.free(chunk)
    assert pool.num_free == 40


def test_sort_free_restores_a_fresh_pools_allocation_order():
    pool, fresh = (TokenToKVPool(40, 1, 1, 2, torch.float32, "cpu") for _ in range(2))
    held = [pool.alloc(n) for n in (7, 5, 9, 3)]
    for chunk in (held[2], held[0], held[3]):
        pool.free(chunk.flip(0))
    pool.sort_free()
    held_slots = set(held[1].tolist())
    want = [s for s in fresh.alloc(40).tolist() if s not in held_slots]  # a fresh pool, minus held[1]
    assert pool.alloc(pool.num_free).tolist() == want
