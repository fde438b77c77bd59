"""The per-request host path kept lean without changing what it does: the sampled tokens read back
exactly, the future-token ring written only when a later step can read it, admission's bookkeeping
only when a request can share a prompt, the radix tree's slots not copied where a view does, the
cached prefix written into its row, and SamplingParams' fast checks agreeing with the full ones."""

from __future__ import annotations

import math
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch

from backplane import Engine, SamplingParams
from backplane.contracts.memory import ReqToTokenPool, TokenToKVPool
from backplane.scheduler.admission import admit_prefill
from backplane.scheduler.overlap import LaunchedStep
from backplane.scheduler.prefix_cache import PrefixCache
from backplane.scheduler.queues import RequestQueues
from backplane.scheduler.radix import RadixTree, join_slots
from backplane.scheduler.request import Req

GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)


def slots(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


# -- the sampled tokens' way back ---------------------------------------------------------------------

def sampled(n: int, token_dtype=torch.int64, logprob_dtype=torch.float32, device="cpu"):
    """n token ids (large ones included) and their log-probabilities (-inf, NaN and a tiny one included)."""
    tokens = torch.tensor([(7 ** i) % 2_000_000_011 for i in range(n)], dtype=token_dtype)
    logprobs = -torch.rand(n, generator=torch.Generator().manual_seed(n), dtype=torch.float64) * 30
    logprobs[:3] = torch.tensor([-math.inf, math.nan, -1e-30])[: min(n, 3)]
    return tokens.to(device), logprobs.to(logprob_dtype).to(device)


def assert_read_exactly(step: LaunchedStep, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
    got = step.new_tokens()
    want_tokens, want_logprobs = tokens.cpu().tolist(), logprobs.cpu().double().tolist()
    assert [t for (t,), _ in got] == want_tokens and all(type(t) is int for (t,), _ in got)
    for (_, (lp,)), want in zip(got, want_logprobs):
        assert (math.isnan(lp) and math.isnan(want)) or lp == want


@pytest.mark.parametrize("n", [1, 3, 17])
def test_a_launched_step_reads_back_every_token_and_log_probability_exactly(n):
    reqs = [Req(i, [1], GREEDY) for i in range(n)]
    tokens, logprobs = sampled(n)
    step = LaunchedStep.launch(reqs, tokens, logprobs)
    tokens.fill_(0)  # NOTE: on CPU the values are read at launch: a later write to the tensors changes nothing
    assert_read_exactly(step, sampled(n)[0], logprobs)
    assert step.reqs == reqs


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 17])
@pytest.mark.parametrize("dtypes", [(torch.int64, torch.float32), (torch.int32, torch.float64)])
def test_a_launched_step_copies_without_a_sync_and_reads_back_exactly_on_cuda(n, dtypes):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    tokens, logprobs = sampled(n, *dtypes, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        step = LaunchedStep.launch([Req(i, [1], GREEDY) for i in range(n)], tokens, logprobs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert step.tokens.is_pinned() and step.logprobs.is_pinned()
    assert_read_exactly(step, tokens, logprobs)


def test_the_future_ring_is_written_only_when_a_later_step_reads_it():
    engine = Engine("tiny-llama", device="cpu", max_total_tokens=1024, max_running_requests=4)
    assert engine.scheduler.overlap
    stored = []
    real_store = engine.scheduler.future.store
    engine.scheduler.future.store = lambda reqs, tokens: (stored.append(len(reqs)), real_store(reqs, tokens))
    prompts = [[5, 6, 7, 8], [9, 10, 11]]

    def run(*max_new):
        stored.clear()
        params = [SamplingParams(max_new_tokens=m, temperature=0.0, ignore_eos=True) for m in max_new]
        outs = engine.generate(input_ids=prompts[:len(max_new)], sampling_params=params)
        assert [len(o.token_ids) for o in outs] == list(max_new)
        return list(stored)

    assert run(1) == [] and run(1, 1) == []  # every prefill sampled its request's last token
    assert run(2) == [1, 1]  # the prefill's token and the decode step's: each read by the next step
    assert run(1, 3)[0] == 2  # a batch with one request going on stores all of its tokens


# -- admission -------------------------------------------------------------------------------------

def enabled_cache(num_slots: int = 64, rows: int = 5) -> PrefixCache:
    return PrefixCache(TokenToKVPool(num_slots, 1, 1, 2, torch.float32, "cpu"), ReqToTokenPool(rows, 64, "cpu"))


def test_admission_keeps_the_in_batch_prompts_only_when_a_later_request_may_share_them():
    cache = enabled_cache()
    batches = []
    real_match = cache.match
    cache.match = lambda req, batch=None: (batches.append(batch), real_match(req, batch))[1]
    lone = RequestQueues(cache.req_pool, cache)
    lone.waiting.append(Req(0, list(range(3, 43)), GREEDY))
    assert admit_prefill(lone, [], token_budget=64, max_running=4, decode_slots_per_request=1)[1] == [40]
    assert batches == [None]
    batches.clear()
    pair = RequestQueues(cache.req_pool, cache)
    shared = list(range(100, 140))
    pair.waiting.extend([Req(1, shared + [1], GREEDY), Req(2, shared + [2], GREEDY)])
    reqs, chunks = admit_prefill(pair, [], token_budget=128, max_running=4, decode_slots_per_request=1)
    assert [r.rid for r in reqs] == [1] and chunks == [41]  # request 2 waits to read the shared 40 from the cache
    assert len(batches) == 2 and all(isinstance(b, RadixTree) for b in batches) and batches[0] is batches[1]


def test_admission_with_nothing_to_prefill_looks_at_nothing():
    cache = enabled_cache()
    queues = RequestQueues(cache.req_pool, cache)
    queues.running.append(Req(0, [1, 2], GREEDY, output_ids=[3], row=1, num_cached=2))  # decoding
    cache.admission_order = cache.make_room = None  # NOTE: a call would raise
    assert admit_prefill(queues, [], token_budget=8, max_running=4, decode_slots_per_request=1) is None


# -- the radix tree and the prefix cache -----------------------------------------------------------

def test_insert_node_is_the_node_where_the_key_ends():
    tree = RadixTree()
    leaf = tree.insert_node([1, 2, 3, 4], slots(11, 12, 13, 14))
    assert leaf.key == [1, 2, 3, 4] and tree.match([1, 2, 3, 4]).node is leaf
    inner = tree.insert_node([1, 2], slots(11, 12))  # ends inside the edge: split there
    assert inner.key == [1, 2] and inner.children[3] is leaf and tree.match([1, 2]).node is inner
    assert tree.insert_node([1, 2, 3, 4], slots(11, 12, 13, 14)) is leaf  # ends at a node boundary
    other = tree.insert_node([1, 2, 7], slots(11, 12, 17))
    assert other.key == [7] and other.parent is inner and tree.match([1, 2, 7]).slots.tolist() == [11, 12, 17]
    assert tree.insert([1, 2, 7, 8], slots(11, 12, 17, 18)) == 3 and tree.total_size == 6


def test_a_match_within_one_edge_shares_its_slots_and_one_over_several_joins_them():
    tree = RadixTree()
    tree.insert([1, 2, 3, 4], slots(11, 12, 13, 14))
    one = tree.match([1, 2, 3, 4])
    assert one.slots.tolist() == [11, 12, 13, 14] and one.slots.data_ptr() == one.node.slots.data_ptr()
    tree.match([1, 2])  # splits the edge after two tokens
    two = tree.match([1, 2, 3, 4])
    assert two.slots.tolist() == [11, 12, 13, 14] and two.length == 4
    assert join_slots([]).numel() == 0 and join_slots([slots(1), slots(2, 3)]).tolist() == [1, 2, 3]


@pytest.mark.parametrize("n", [1, 5, 32, 33, 300])  # compared as lists up to 32 slots, by a mask beyond
def test_insert_frees_exactly_the_duplicate_slots_in_order(n):
    freed = []
    tree = RadixTree(lambda s: freed.append((s.dtype, s.tolist())))
    key = list(range(100, 100 + n))
    cached = torch.arange(1, n + 1)
    tree.insert(key, cached)
    given = cached.clone()
    given[::3] += 1000  # every third token computed again in a slot of its own
    assert tree.insert(key, given) == n
    assert freed == [(torch.int64, given[::3].tolist())]
    assert tree.match(key).slots.tolist() == cached.tolist()  # the tree keeps its own slots
    assert tree.insert(key, cached) == n and len(freed) == 1  # the same slots again: nothing to free


def test_a_cached_prefix_lands_in_its_row_and_goes_back_to_the_tree_on_release():
    cache = enabled_cache()
    prompt = list(range(3, 23))
    cache.tree.insert(prompt, cache.kv_pool.alloc(20))
    req = Req(0, prompt + [99], GREEDY)
    assert cache.match(req) and req.num_shared == 20
    req.row = cache.req_pool.alloc()
    cache.admit(req)
    row = cache.req_pool.req_to_token[req.row]
    assert row[:20].tolist() == req.slots[0].tolist() and row.dtype == torch.int32 and not row[20:].any()
    free = cache.kv_pool.num_free
    req.slots.append(cache.kv_pool.alloc(1))
    req.num_cached = 21
    cache.cache_prefilled(req, 1)
    assert req.num_shared == 21 and req.prefix_node is cache.tree.match(prompt + [99]).node
    cache.release(req, keep=True)
    assert cache.tree.total_size == 21 and cache.tree.evictable_size == 21 and cache.kv_pool.num_free == free - 1


# -- SamplingParams' checks -------------------------------------------------------------------------

class Level(int):
    """An int subclass: valid wherever an int is."""


@pytest.mark.parametrize("field, value, valid", [
    ("max_new_tokens", 3, True), ("max_new_tokens", True, False), ("max_new_tokens", 3.0, False),
    ("max_new_tokens", Level(2), True), ("max_new_tokens", 0, False), ("temperature", 1, True),
    ("temperature", 0.5, True), ("temperature", False, False), ("temperature", math.nan, False),
    ("temperature", math.inf, False), ("temperature", -0.1, False), ("temperature", Fraction(1, 2), True),
    ("temperature", "1", False), ("top_p", 1, True), ("top_p", 0, False), ("top_k", -1, True), ("top_k", 1.0, False),
    ("seed", Level(5), True), ("seed", 2**64, False), ("min_p", 1.5, False),
])
def test_sampling_params_accept_and_refuse_as_the_number_types_say(field, value, valid):
    params = SamplingParams()
    setattr(params, field, value)
    problem = params.problem()
    assert (problem is None) == valid, problem
    if not valid:
        assert problem.startswith(f"SamplingParams.{field}: expected ")


def test_sampling_params_accept_numpy_numbers():
    np = pytest.importorskip("numpy")
    params = SamplingParams(max_new_tokens=np.int64(3), temperature=np.float32(0.5), top_k=np.int32(4))
    assert params.problem() is None
    params.temperature = np.float64("nan")
    assert params.problem().startswith("SamplingParams.temperature")


def test_an_unknown_adapter_is_still_refused_when_none_are_loaded():
    engine = SimpleNamespace(args=SimpleNamespace(lora_path_map={}))
    assert Engine._adapter_error(engine, Req(0, [1], GREEDY)) is None
    assert "unknown LoRA adapter 'x'" in Engine._adapter_error(engine, Req(1, [1], GREEDY, lora="x"))
