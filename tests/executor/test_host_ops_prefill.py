"""The host side of a step before its graph launch, counted in torch operators: building the batch
(`build_extend_batch`, `build_decode_batch`) and padding it into the static buffers (`pad_into`).

Every torch operator a step calls costs host time before the launch (Python, the dispatcher, a
tensor made), whatever device it runs on, views and CPU tensors included; so these tests count
every aten operator (`AtenOps`), not only device ones. The padded content is checked against the
torch-operator padding it replaces (`reference_block`), on randomized batches.
"""

from __future__ import annotations

import random
from itertools import accumulate

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from backplane.contracts.batch import ForwardMode
from backplane.contracts.graph import GraphKey
from backplane.executor.graph_runner import StaticInputs, pad_into
from backplane.scheduler.batch_builder import build_decode_batch, build_extend_batch
from helpers_scheduler import cpu_pools, expected_fields, placed_reqs
from test_replay_inputs import PAD_ROW, Spec, garbage_static

EXTEND, DECODE, VERIFY = ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY


class AtenOps(TorchDispatchMode):
    """Every aten operator run inside the block, on any device (views and host tensors included)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_the_counter_counts_host_views_and_copies():
    t = torch.arange(6)
    with torch.inference_mode(), AtenOps() as ops:
        t[1:3].view(torch.int32).clone()
        t.tolist()
    assert {"slice", "view", "clone", "resolve_conj", "resolve_neg"} <= set(ops.ops)


# -- the batch builder ----------------------------------------------------------------------------

def _pools():
    return cpu_pools(16, 1024, 4096)


def _build(kind, req_pool, kv_pool):
    """(requests, the batch of `kind`) as the launcher builds it (a cached prompt's last token: DECODE)."""
    if kind.startswith("extend"):
        lens = [int(k) for k in kind.split("-")[1:]]
        reqs = placed_reqs(req_pool, [list(range(1, k + 1)) for k in lens], [0] * len(lens))
        return reqs, build_extend_batch(reqs, lens, kv_pool, req_pool)
    if kind == "cached-511":
        reqs = placed_reqs(req_pool, [list(range(1, 513))], [511])
        batch = build_decode_batch(reqs, kv_pool, req_pool)
        batch.host.prefix_parts = [(req.slots, req.num_cached) for req in reqs]
        return reqs, batch
    bs = int(kind.split("-")[1])
    reqs = placed_reqs(req_pool, [list(range(1, 40))] * bs, [38] * bs)
    return reqs, build_decode_batch(reqs, kv_pool, req_pool)


# Operators of a built batch: 4 of kv_pool.alloc (slice, clone, lift_fresh, index_put_), 5 of the builder
# (the copy, two splits and a dtype view of it, the req_to_token scatter), one more to split the slots
# among several requests, one more for the int32 cast of more than 128 slots. Before: 32, 36, 34, 27, 27, 33.
BUILD_BOUNDS = [("extend-128", 9), ("extend-512", 10), ("extend-100-20-8", 10), ("cached-511", 9),
                ("decode-1", 9), ("decode-8", 10)]


@pytest.mark.parametrize("kind,bound", BUILD_BOUNDS, ids=[k for k, _ in BUILD_BOUNDS])
def test_operators_of_a_built_batch(kind, bound):
    req_pool, kv_pool = _pools()
    with torch.inference_mode(), AtenOps() as ops:  # as Scheduler.step builds
        _build(kind, req_pool, kv_pool)
    assert len(ops.ops) <= bound, ops.ops
    assert ops.ops.count("to") == 1 and ops.ops.count("index_put_") == 2  # one copy, one scatter (+ alloc's)


def _random_batch(rng, req_pool, kv_pool, decode):
    """Requests with a cached prefix built by an earlier batch (slots from a scrambled free list),
    then the batch under test: their next chunk, or one token each."""
    kv_pool.alloc(rng.randrange(1, 50))
    kv_pool.free(kv_pool.alloc(rng.randrange(5, 30))[torch.randperm(5)[:3]])
    bs = rng.randrange(1, 6)
    prompts = [[rng.randrange(1, 30000) for _ in range(rng.randrange(2, 200))] for _ in range(bs)]
    prefix = [len(p) - 1 if decode else rng.randrange(0, len(p)) for p in prompts]
    reqs = placed_reqs(req_pool, prompts, [0] * bs)
    with_prefix = [(r, p) for r, p in zip(reqs, prefix) if p]
    if with_prefix:
        build_extend_batch([r for r, _ in with_prefix], [p for _, p in with_prefix], kv_pool, req_pool)
    for req, p in zip(reqs, prefix):
        req.num_cached = p
    new = [1 if decode else len(q) - p for q, p in zip(prompts, prefix)]
    batch = build_decode_batch(reqs, kv_pool, req_pool) if decode else build_extend_batch(reqs, new, kv_pool, req_pool)
    return reqs, prompts, prefix, new, batch


@pytest.mark.parametrize("decode", [False, True], ids=["extend", "decode"])
@pytest.mark.parametrize("seed", range(8))
def test_built_batch_fields(seed, decode):
    """Every field a plugin reads: values, dtype, shape and device; req_to_token and the requests'
    slot records; host copies over storages of their own size (tensor parallelism pickles them)."""
    rng = random.Random(seed)
    req_pool, kv_pool = _pools()
    reqs, prompts, prefix, new, batch = _random_batch(rng, req_pool, kv_pool, decode)
    slots = [req.slots[-1].tolist() for req in reqs]
    assert [len(s) for s in slots] == new
    flat = [s for part in slots for s in part]
    ids = [t for q, p, k in zip(prompts, prefix, new) for t in q[p:p + k]]
    positions = [p + j for p, k in zip(prefix, new) for j in range(k)]
    want = expected_fields(ids, positions, flat, [r.row for r in reqs], prefix, new, extend=not decode)
    if decode:
        assert batch.extend_seq_lens is None and batch.extend_seq_lens_cpu is None
    for name, (values, dtype) in want.items():
        tensor = getattr(batch, name)
        got = (tensor.tolist(), tensor.dtype, tensor.shape, tensor.device.type)
        assert got == (values, dtype, (len(values),), "cpu"), name
    host = batch.host
    assert (host.input_ids.tolist(), host.positions.tolist(), host.out_cache_loc.tolist(),
            host.req_pool_indices.tolist()) == (ids, positions, flat, [r.row for r in reqs])
    for tensor in (host.input_ids, host.positions, host.out_cache_loc, host.req_pool_indices, batch.seq_lens_cpu,
                   batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu):
        if tensor is not None:
            assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    assert len(set(flat)) == len(flat) and 0 not in flat
    for req, p, k, part in zip(reqs, prefix, new, slots):
        assert req_pool.req_to_token[req.row, p:p + k].tolist() == part
    batch.seq_lens.add_(1)
    assert batch.seq_lens_cpu.tolist() == want["seq_lens"][0], "seq_lens_cpu shares memory with seq_lens"


# -- the padding ----------------------------------------------------------------------------------

def reference_block(static: StaticInputs, batch, key: GraphKey, fill: int) -> torch.Tensor:
    """The static block's first `width` columns after padding `batch` to `key`, by the torch-operator
    padding pad_into replaced: the key's padding, the batch over it, then extend lengths, logits rows
    and indptrs by cumsum. Token and request values from the batch's device tensors."""
    pbs, pn, tpr = key.batch_size, key.num_tokens, key.tokens_per_request
    n, bs = batch.num_tokens, batch.batch_size
    block = torch.zeros((10, static.views(pbs, pn).width), dtype=torch.int64)
    block[3, :pbs] = PAD_ROW
    lens = block[6:9].view(torch.int32)  # seq lens, prefix lens, extend lens
    lens[0, :pbs] = 0 if key.ragged else fill
    lens[2, :pbs] = tpr if key.mode is VERIFY else 0
    for row, tensor in enumerate([batch.input_ids, batch.positions, batch.out_cache_loc]):
        block[row, :n] = tensor
    block[3, :bs] = batch.req_pool_indices
    lens[0, :bs] = batch.seq_lens_cpu
    if key.ragged:
        new = batch.extend_seq_lens_cpu.to(torch.int32)
        prefix = batch.extend_prefix_lens_cpu
        lens[1, :bs] = prefix if prefix is not None else batch.seq_lens_cpu - new
        lens[2, :bs] = new
        if pbs > bs:
            lens[0, bs] = lens[2, bs] = pn - n
        block[4, :bs] = torch.cumsum(new, 0) - 1
        block[9].view(torch.int32)[1:pbs + 1] = torch.cumsum(lens[2, :pbs], 0)
    if key.mode is VERIFY:
        lens[1, :pbs] = lens[0, :pbs] - tpr
        block[5, 1:pbs + 1] = torch.cumsum(lens[0, :pbs].to(torch.int64), 0) * tpr
    return block


def _random_spec(rng, mode, padded):
    """(a Spec of random values, its key) of `mode`, the key padded or an exact fit."""
    bs = rng.randrange(1, 4)
    rows = rng.sample(range(PAD_ROW), bs)
    if mode is EXTEND:
        new, prefix = [rng.randrange(1, 9) for _ in range(bs)], [rng.randrange(0, 20) for _ in range(bs)]
        n = sum(new)
        key = GraphKey(EXTEND, bs + rng.randrange(1, 3), 0, token_bucket=n + rng.randrange(1, 6)) if padded \
            else GraphKey(EXTEND, bs, 0, token_bucket=n)
    else:
        tpr = rng.randrange(2, 4) if mode is VERIFY else 1
        new, prefix = [tpr] * bs, [rng.randrange(0, 20) for _ in range(bs)]
        key = GraphKey(mode, bs + (rng.randrange(1, 3) if padded else 0), tpr)
    mask = [rng.random() < 0.5 for _ in range(sum(k * (p + k) for p, k in zip(prefix, new)))] if mode is VERIFY else None
    spec = Spec(mode, prefix, new, rows, ids=[rng.randrange(0, 30000) for _ in range(sum(new))], mask=mask)
    spec.slots = [rng.randrange(1, 4000) for _ in range(sum(new))]
    return spec, key


CASES = [(EXTEND, False), (EXTEND, True), (DECODE, False), (DECODE, True), (VERIFY, False), (VERIFY, True)]


@pytest.mark.parametrize("mode,padded", CASES, ids=["extend", "padded-extend", "decode", "padded-decode", "verify",
                                                    "padded-verify"])
@pytest.mark.parametrize("seed", range(6))
def test_padded_block_equals_the_torch_padding(seed, mode, padded):
    rng = random.Random(1000 * seed + CASES.index((mode, padded)))
    spec, key = _random_spec(rng, mode, padded)
    fill = 5 if mode is VERIFY else 1
    # from the host copies or the device tensors; into a whole block or its key's columns (strided)
    for host, max_tokens in [(True, 64), (False, 64), (True, 2048)]:
        batch = spec.batch(host=host, prefix_cpu=rng.random() < 0.7)
        static = garbage_static(max_bs=8, max_tokens=max_tokens, mask_size=8 * 3 * 64)
        view = pad_into(static, batch, key, PAD_ROW, fill)
        want = reference_block(static, batch, key, fill)
        width = want.shape[1]
        assert torch.equal(static.block[:, :width], want)
        lens = want[6:9].view(torch.int32)[:, :key.batch_size]
        assert torch.equal(view.seq_lens_cpu, lens[0]) and view.seq_lens_cpu.dtype == torch.int32
        if key.ragged or mode is VERIFY:
            assert torch.equal(view.extend_prefix_lens_cpu, lens[1]) and torch.equal(view.extend_seq_lens_cpu, lens[2])
        if mode is VERIFY:
            indptr = want[5, :key.batch_size + 1].tolist()
            real = indptr[len(spec.rows)]
            assert view.custom_mask.tolist() == spec.mask[:real] + [True] * (indptr[-1] - real)
        if key.ragged:
            assert view.extend_indptr.tolist() == [0] + list(accumulate(lens[2].tolist()))


def test_a_padded_batch_keeps_its_host_values_after_the_next_padding():
    """The padded batch's host copies are its own block (a fresh one per padding), not the next's."""
    static = garbage_static()
    first = pad_into(static, Spec(DECODE, [4, 9], [1, 1], [0, 2]).batch(), GraphKey(DECODE, 4, 1), PAD_ROW, 1)
    pad_into(static, Spec(DECODE, [7], [1], [3]).batch(), GraphKey(DECODE, 4, 1), PAD_ROW, 1)
    assert first.seq_lens_cpu.tolist() == [5, 10, 1, 1]


# Operators of pad_into on CPU (the copy is the device's one; a strided destination adds a view of
# the host block; a verify its mask's copy, fill and views; placeholders the ids' device copy).
# Before: 45, 53, 23, 23, 22 and 48 (in PAD_BOUNDS order), 53 into the strided block.
PAD_BOUNDS = [
    ("extend-128", Spec(EXTEND, [0], [128], [1]), GraphKey(EXTEND, 1, 0, token_bucket=128), {}, 1),
    ("extend-padded", Spec(EXTEND, [5, 0], [100, 20], [1, 2]), GraphKey(EXTEND, 4, 0, token_bucket=128), {}, 1),
    ("decode-1", Spec(DECODE, [511], [1], [1]), GraphKey(DECODE, 1, 1), {}, 1),
    ("decode-padded", Spec(DECODE, [4, 9, 2], [1, 1, 1], [0, 2, 1]), GraphKey(DECODE, 4, 1), {}, 1),
    ("decode-placeholders", Spec(DECODE, [4, 9, 2], [1, 1, 1], [0, 2, 1]), GraphKey(DECODE, 4, 1),
     {"host_ids": [-3, 12, -1]}, 3),
    ("verify", Spec(VERIFY, [4, 6], [3, 3], [0, 2], mask=[True] * (3 * 7 + 3 * 9)), GraphKey(VERIFY, 4, 3), {}, 8),
]


@pytest.mark.parametrize("name,spec,key,kwargs,bound", PAD_BOUNDS, ids=[c[0] for c in PAD_BOUNDS])
def test_operators_of_a_padding(name, spec, key, kwargs, bound):
    static = StaticInputs.allocate(160, 512, "cpu", mask_size=160 * 3 * 64)  # the default buffers: one whole block
    batch, fill = spec.batch(**kwargs), 5 if key.mode is VERIFY else 1
    pad_into(static, batch, key, PAD_ROW, fill)  # the key's padding is made once
    with torch.inference_mode(), AtenOps() as ops:
        pad_into(static, batch, key, PAD_ROW, fill)
    assert len(ops.ops) <= bound, ops.ops
    assert ops.ops.count("copy_") == 1 + (key.mode is VERIFY) + ("host_ids" in kwargs)


def test_operators_of_a_padding_into_a_strided_block():
    static = StaticInputs.allocate(8, 2048, "cpu")  # over 64 KiB: the key's columns only
    batch = Spec(EXTEND, [4, 0, 9], [3, 5, 2], [1, 2, 3]).batch()
    key = GraphKey(EXTEND, 8, 0, token_bucket=16)
    pad_into(static, batch, key, PAD_ROW, 1)
    with torch.inference_mode(), AtenOps() as ops:
        pad_into(static, batch, key, PAD_ROW, 1)
    assert ops.ops == ["view", "copy_"]
