"""The graph runner's replay inputs (`pad_into`): what the static buffers hold after padding, and
how many device operations writing them takes.

Device operations are counted on the meta device (`DeviceOps`): the static buffers and a batch's
device tensors live there, its host copies on the CPU. Reading a meta tensor's value on the host
raises, so a padding that would synchronize with the device fails these tests too. Expected values
are written out here from the padding rules, not taken from the runner.
"""

from __future__ import annotations

from itertools import accumulate

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from backplane.contracts.batch import ForwardBatch, ForwardMode, HostBatch
from backplane.contracts.graph import GraphKey
from backplane.contracts.memory import ReqToTokenPool, TokenToKVPool
from backplane.executor.graph_runner import StaticInputs, pad_into
from backplane.plugins.attention_triton.graph import GraphBuffers
from backplane.scheduler.batch_builder import build_decode_batch, build_extend_batch
from backplane.scheduler.decode_state import DecodeState
from backplane.scheduler.overlap import FutureTokens
from helpers_scheduler import cpu_pools, expected_fields, placed_reqs

PAD_ROW = 9
EXTEND, DECODE, VERIFY = ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY


class DeviceOps(TorchDispatchMode):
    """Counts the device operations of the code it runs: every aten op but a view that touches a
    tensor on the meta device. A copy from the host into a strided device destination counts two,
    as on CUDA (a copy into a staging tensor, then a device kernel)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            if any(t.device.type == "meta" for t in tensors):
                self.ops.append(func.overloadpacket.__name__)
                if func is torch.ops.aten.copy_.default and args[1].device.type == "cpu" and not args[0].is_contiguous():
                    self.ops.append("strided copy kernel")
        return out

    @property
    def count(self) -> int:
        return len(self.ops)


class Spec:
    """A batch as plain lists; `batch()` builds it with device tensors on `device` and, unless told
    otherwise, host copies (HostBatch) as the batch builder keeps them."""

    def __init__(self, mode, prefix, new, rows, ids=None, mask=None):
        self.mode, self.prefix, self.new, self.rows = mode, list(prefix), list(new), list(rows)
        n = sum(new)
        self.ids = list(ids) if ids is not None else [1000 + i for i in range(n)]
        self.positions = [p + j for p, k in zip(prefix, new) for j in range(k)]
        self.slots = [100 + i for i in range(n)]
        self.seq = [p + k for p, k in zip(prefix, new)]
        self.mask = mask

    def batch(self, device="cpu", host=True, host_ids=None, prefix_cpu=True) -> ForwardBatch:
        def t(xs, dtype=torch.int64):
            return torch.tensor(xs, dtype=dtype)

        seq = t(self.seq, torch.int32)
        batch = ForwardBatch(
            forward_mode=self.mode, batch_size=len(self.rows), input_ids=t(self.ids).to(device),
            positions=t(self.positions).to(device), req_pool_indices=t(self.rows).to(device),
            seq_lens=seq.to(device), seq_lens_cpu=seq.clone(), out_cache_loc=t(self.slots).to(device),
            req_to_token_pool=None, token_to_kv_pool=None,
            host=HostBatch(input_ids=t(host_ids if host_ids is not None else self.ids), positions=t(self.positions),
                           out_cache_loc=t(self.slots), req_pool_indices=t(self.rows)) if host else None,
        )
        if self.mode is EXTEND:
            batch.extend_seq_lens_cpu = t(self.new, torch.int32)
            batch.extend_seq_lens = batch.extend_seq_lens_cpu.to(device)
            if prefix_cpu:
                batch.extend_prefix_lens_cpu = t(self.prefix, torch.int32)
                batch.extend_prefix_lens = batch.extend_prefix_lens_cpu.to(device)
        if self.mask is not None:
            batch.custom_mask = torch.tensor(self.mask, dtype=torch.bool).to(device)
        return batch


def expected(spec: Spec, key: GraphKey, fill: int) -> dict[str, list]:
    """The padded buffers by the rules: padded tokens id, position and slot 0; padded requests on
    row PAD_ROW. Uniform keys: padded seq_len `fill`; a verify's tpr new tokens per request and an
    all-visible mask for the padded ones. Extend keys: the first padded request takes the bucket's
    spare tokens (no prefix), later ones none; logits rows: each real request's last token, else 0."""
    bs, n, pbs, pn = len(spec.rows), len(spec.ids), key.batch_size, key.num_tokens
    out = {"input_ids": spec.ids + [0] * (pn - n), "positions": spec.positions + [0] * (pn - n),
           "out_cache_loc": spec.slots + [0] * (pn - n), "req_pool_indices": spec.rows + [PAD_ROW] * (pbs - bs)}
    if key.ragged:
        pad_new = ([pn - n] + [0] * (pbs - bs - 1)) if pbs > bs else []
        out["extend_seq_lens"] = spec.new + pad_new
        out["extend_prefix_lens"] = spec.prefix + [0] * (pbs - bs)
        out["seq_lens"] = spec.seq + pad_new
        out["logits_indices"] = [i - 1 for i in accumulate(spec.new)] + [0] * (pbs - bs)
        out["extend_indptr"] = [0] + list(accumulate(out["extend_seq_lens"]))
        return out
    out["seq_lens"] = spec.seq + [fill] * (pbs - bs)
    if key.mode is VERIFY:
        tpr = key.tokens_per_request
        out["extend_seq_lens"] = [tpr] * pbs
        out["extend_prefix_lens"] = [s - tpr for s in out["seq_lens"]]
        out["mask_indptr"] = [0] + list(accumulate(tpr * s for s in out["seq_lens"]))
        real = sum(tpr * s for s in spec.seq)
        out["custom_mask"] = spec.mask[:real] + [True] * (out["mask_indptr"][-1] - real)
    return out


def check(view: ForwardBatch, want: dict[str, list]) -> None:
    """The view's device tensors and their host copies hold `want`."""
    for name, values in want.items():
        assert getattr(view, name).tolist() == values, name
    assert view.seq_lens_cpu.tolist() == want["seq_lens"]
    if "extend_seq_lens" in want:
        assert view.extend_seq_lens_cpu.tolist() == want["extend_seq_lens"]
        assert view.extend_prefix_lens_cpu.tolist() == want["extend_prefix_lens"]


def garbage_static(max_bs=8, max_tokens=32, mask_size=0, device="cpu") -> StaticInputs:
    """Static buffers full of stale values: every padded field must be written, not assumed."""
    static = StaticInputs.allocate(max_bs, max_tokens, device, mask_size)
    if device != "meta":
        static.block.fill_(-7)
        static.custom_mask.fill_(False)
    return static


# -- values -------------------------------------------------------------------------------------

EXTEND_NO_PREFIX = Spec(EXTEND, [0, 0, 0], [3, 5, 2], [1, 2, 3])
EXTEND_PREFIX = Spec(EXTEND, [4, 0, 9], [3, 5, 2], [1, 2, 3])
DECODE_3 = Spec(DECODE, [4, 9, 2], [1, 1, 1], [0, 2, 1], ids=[11, 12, 13])
VERIFY_2 = Spec(VERIFY, [4, 6], [3, 3], [0, 2], ids=[21, 22, 23, 24, 25, 26],
                mask=[bool((i * 7) % 3) for i in range(3 * 7 + 3 * 9)])


@pytest.mark.parametrize("spec,key", [
    (EXTEND_NO_PREFIX, GraphKey(EXTEND, 8, 0, token_bucket=16)),  # padded slots and tokens
    (EXTEND_PREFIX, GraphKey(EXTEND, 8, 0, token_bucket=16)),
    (EXTEND_PREFIX, GraphKey(EXTEND, 4, 0, token_bucket=11)),  # one padded request, one token
    (Spec(EXTEND, [2, 0], [6, 2], [1, 2]), GraphKey(EXTEND, 2, 0, token_bucket=8)),  # exact fit
    (DECODE_3, GraphKey(DECODE, 4, 1)),
    (DECODE_3, GraphKey(DECODE, 3, 1)),
])
@pytest.mark.parametrize("host", [True, False], ids=["host-copies", "device-only"])
def test_padded_buffers(spec, key, host):
    static = garbage_static()
    view = pad_into(static, spec.batch(host=host), key, PAD_ROW, fill=1)
    assert view.batch_size == key.batch_size and view.num_tokens == key.num_tokens and view.forward_mode is key.mode
    check(view, expected(spec, key, fill=1))


def test_extend_prefix_lengths_from_seq_lens_when_absent():
    """An extend batch without extend_prefix_lens_cpu: prefix = seq_len - new tokens."""
    key = GraphKey(EXTEND, 8, 0, token_bucket=16)
    view = pad_into(garbage_static(), EXTEND_PREFIX.batch(prefix_cpu=False), key, PAD_ROW, fill=1)
    check(view, expected(EXTEND_PREFIX, key, fill=1))


@pytest.mark.parametrize("host", [True, False], ids=["host-copies", "device-only"])
def test_padded_verify_with_a_custom_mask(host):
    key = GraphKey(VERIFY, 4, 3)
    static = garbage_static(mask_size=4 * 3 * 64)
    view = pad_into(static, VERIFY_2.batch(host=host), key, PAD_ROW, fill=5)
    want = expected(VERIFY_2, key, fill=5)
    assert want["extend_prefix_lens"] == [4, 6, 2, 2] and want["mask_indptr"] == [0, 21, 48, 63, 78]
    check(view, want)


def test_overlap_placeholders_come_from_the_device():
    """Input ids still in flight are negative placeholders on the host; the device holds them
    resolved: the padded ids are the device's, everything else may come from the host."""
    batch = DECODE_3.batch(host_ids=[-3, 12, -1])  # device ids: 11, 12, 13
    view = pad_into(garbage_static(), batch, GraphKey(DECODE, 4, 1), PAD_ROW, fill=1)
    check(view, expected(DECODE_3, GraphKey(DECODE, 4, 1), fill=1))


def test_host_copies_are_used_when_present():
    """With host copies, the device's token and request tensors are not read: they may differ."""
    batch = DECODE_3.batch()
    batch.positions, batch.out_cache_loc = torch.full((3,), -5), torch.full((3,), -6)
    batch.req_pool_indices, batch.seq_lens = torch.full((3,), -8), torch.full((3,), -9, dtype=torch.int32)
    check(pad_into(garbage_static(), batch, GraphKey(DECODE, 4, 1), PAD_ROW, 1), expected(DECODE_3, GraphKey(DECODE, 4, 1), 1))


def test_a_replay_keeps_no_value_of_the_previous_one():
    static = garbage_static()
    pad_into(static, EXTEND_PREFIX.batch(), GraphKey(EXTEND, 8, 0, token_bucket=32), PAD_ROW, 1)
    small = Spec(EXTEND, [5], [2], [4])
    key = GraphKey(EXTEND, 2, 0, token_bucket=4)
    check(pad_into(static, small.batch(), key, PAD_ROW, 1), expected(small, key, 1))


def test_a_key_larger_than_the_static_buffers_is_refused():
    with pytest.raises(ValueError, match=r"at most 8 requests and 32 tokens .* got 8 requests x 64 tokens"):
        pad_into(garbage_static(), EXTEND_PREFIX.batch(), GraphKey(EXTEND, 8, 0, token_bucket=64), PAD_ROW, 1)


# -- batches of the scheduler --------------------------------------------------------------------

def _pools():
    return cpu_pools(10, 64, 256)


def test_builder_extend_batch_over_a_prefix():
    req_pool, kv_pool = _pools()
    reqs = placed_reqs(req_pool, [[5, 6, 7, 8, 9], [3, 4]], [0, 0])
    first = build_extend_batch(reqs[:1], [3], kv_pool, req_pool)  # the first 3 tokens of request 0
    reqs[0].num_cached = 3
    batch = build_extend_batch(reqs, [2, 2], kv_pool, req_pool)  # 2 more over a prefix of 3; request 1 whole
    slots = batch.host.out_cache_loc.tolist()
    spec = Spec(EXTEND, [3, 0], [2, 2], [reqs[0].row, reqs[1].row], ids=[8, 9, 3, 4])
    spec.slots = slots
    key = GraphKey(EXTEND, 4, 0, token_bucket=8)
    check(pad_into(garbage_static(), batch, key, PAD_ROW, 1), expected(spec, key, 1))
    assert first.num_tokens == 3


def test_decode_state_batches_under_overlap():
    """DecodeState's batches: rebuilt from host lists with placeholders resolved on the device, then
    advanced in place (host ids all in flight, the device's are the sampled tokens)."""
    req_pool, kv_pool = _pools()
    reqs = placed_reqs(req_pool, [[5, 6, 7], [3, 4, 8]], [3, 3])
    future = FutureTokens(4, "cpu")
    future.store(reqs, torch.tensor([41, 42]))
    state = DecodeState(kv_pool, req_pool, future)
    key = GraphKey(DECODE, 4, 1)
    rebuilt = state.build(reqs)
    assert rebuilt.host.has_placeholders
    spec = Spec(DECODE, [3, 3], [1, 1], [reqs[0].row, reqs[1].row], ids=[41, 42])
    spec.slots = rebuilt.host.out_cache_loc.tolist()
    check(pad_into(garbage_static(), rebuilt, key, PAD_ROW, 1), expected(spec, key, 1))
    for req in reqs:
        req.num_cached += 1
    state.commit(reqs, torch.tensor([51, 52]))
    advanced = state.build(reqs)
    assert state.num_reused == 1 and advanced.host.input_ids.tolist() == [-1, -1]
    spec = Spec(DECODE, [4, 4], [1, 1], [reqs[0].row, reqs[1].row], ids=[51, 52])
    spec.slots = advanced.host.out_cache_loc.tolist()
    check(pad_into(garbage_static(), advanced, key, PAD_ROW, 1), expected(spec, key, 1))


def test_builder_decode_batch():
    req_pool, kv_pool = _pools()
    reqs = placed_reqs(req_pool, [[5, 6, 7], [3, 4, 8, 2], [1]], [2, 3, 0])
    batch = build_decode_batch(reqs, kv_pool, req_pool)
    spec = Spec(DECODE, [2, 3, 0], [1, 1, 1], [r.row for r in reqs], ids=[7, 2, 1])
    spec.slots = batch.host.out_cache_loc.tolist()
    key = GraphKey(DECODE, 8, 1)
    check(pad_into(garbage_static(), batch, key, PAD_ROW, 1), expected(spec, key, 1))


@pytest.mark.parametrize("mode", [EXTEND, DECODE])
def test_builder_device_tensors(mode):
    """The batch's device tensors (not only its host copies, which the padding reads): values and
    dtypes of the ForwardBatch contract, req_to_token written, and seq_lens apart from seq_lens_cpu
    (DecodeState advances both in place)."""
    req_pool, kv_pool = _pools()
    reqs = placed_reqs(req_pool, [[5, 6, 7, 8, 9], [3, 4, 2]], [2, 1] if mode is DECODE else [0, 0])
    if mode is EXTEND:
        build_extend_batch(reqs[:1], [3], kv_pool, req_pool)
        reqs[0].num_cached = 3
        batch = build_extend_batch(reqs, [2, 3], kv_pool, req_pool)
        new, prefix, ids, positions = [2, 3], [3, 0], [8, 9, 3, 4, 2], [3, 4, 0, 1, 2]
    else:
        batch = build_decode_batch(reqs, kv_pool, req_pool)
        new, prefix, ids, positions = [1, 1], [2, 1], [7, 4], [2, 1]
    rows, slots = [r.row for r in reqs], batch.host.out_cache_loc.tolist()
    want = expected_fields(ids, positions, slots, rows, prefix, new, extend=mode is EXTEND)
    if mode is not EXTEND:
        assert batch.extend_seq_lens is None and batch.extend_prefix_lens is None
    for name, (values, dtype) in want.items():
        tensor = getattr(batch, name)
        assert (tensor.tolist(), tensor.dtype) == (values, dtype), name
    token_rows = [row for row, k in zip(rows, new) for _ in range(k)]
    assert req_pool.req_to_token[token_rows, positions].tolist() == slots
    assert len(set(slots)) == len(slots) and 0 not in slots
    batch.seq_lens.add_(1)
    assert batch.seq_lens_cpu.tolist() == want["seq_lens"][0], "seq_lens_cpu shares memory with the device seq_lens"
    assert batch.host.input_ids.tolist() == ids and batch.host.positions.tolist() == positions


def test_builder_long_prefill_packs_its_slots_alike():
    """More slots than the builder packs through lists (host tensor copies instead): same contract."""
    req_pool, kv_pool = ReqToTokenPool(4, 512, "cpu"), TokenToKVPool(1024, 1, 1, 8, torch.float32, "cpu")
    reqs = placed_reqs(req_pool, [list(range(7, 307)), [3, 4, 2]], [0, 0])
    kv_pool.alloc(5)  # the slots are not 1, 2, ...
    batch = build_extend_batch(reqs, [300, 3], kv_pool, req_pool)
    slots = batch.host.out_cache_loc.tolist()
    assert len(slots) == 303 and len(set(slots)) == 303
    assert batch.out_cache_loc.tolist() == slots and batch.out_cache_loc.dtype == torch.int64
    assert batch.input_ids.tolist() == list(range(7, 307)) + [3, 4, 2]
    assert batch.seq_lens.tolist() == batch.seq_lens_cpu.tolist() == [300, 3] and batch.seq_lens.dtype == torch.int32
    assert batch.extend_seq_lens.tolist() == [300, 3] and batch.extend_prefix_lens.tolist() == [0, 0]
    assert req_pool.req_to_token[reqs[0].row, :300].tolist() == slots[:300]
    assert req_pool.req_to_token[reqs[1].row, :3].tolist() == slots[300:]


# -- device operations ---------------------------------------------------------------------------

@pytest.mark.parametrize("mode", [EXTEND, DECODE])
def test_device_operations_of_a_built_batch(mode):
    """The batch builder: one copy of the packed host tensor (the int32 fields cast on the host) and
    one scatter into req_to_token; before, two more (casts of the lengths and slots on the device)."""
    req_pool, kv_pool = ReqToTokenPool(10, 64, "meta"), TokenToKVPool(256, 1, 1, 8, torch.float32, "meta")
    reqs = placed_reqs(req_pool, [[5, 6, 7, 8, 9], [3, 4, 2]], [3, 1])
    with DeviceOps() as ops:
        if mode is EXTEND:
            batch = build_extend_batch(reqs, [2, 2], kv_pool, req_pool)
        else:
            batch = build_decode_batch(reqs, kv_pool, req_pool)
    assert ops.ops == ["_to_copy", "index_put_"]
    assert batch.seq_lens.device.type == "meta" and batch.seq_lens.dtype == torch.int32
    assert batch.seq_lens_cpu.tolist() == ([5, 3] if mode is EXTEND else [4, 2])


# Before the host-built padding (commit 08ede52): 9, 19, 10, 10, 10 and 15 device operations.
OP_BOUNDS = [
    ("extend, exact fit", Spec(EXTEND, [2, 0], [6, 2], [1, 2]), GraphKey(EXTEND, 2, 0, token_bucket=8), {}, 1),
    ("extend, padded", EXTEND_PREFIX, GraphKey(EXTEND, 8, 0, token_bucket=16), {}, 1),
    ("decode, padded", DECODE_3, GraphKey(DECODE, 4, 1), {}, 1),
    ("decode, placeholders", DECODE_3, GraphKey(DECODE, 4, 1), {"host_ids": [-3, 12, -1]}, 2),
    ("decode, no host copies", DECODE_3, GraphKey(DECODE, 4, 1), {"host": False}, 6),
    ("verify, padded", VERIFY_2, GraphKey(VERIFY, 4, 3), {}, 3),
]


@pytest.mark.parametrize("name,spec,key,kwargs,bound", OP_BOUNDS, ids=[c[0] for c in OP_BOUNDS])
def test_device_operations_of_a_padding(name, spec, key, kwargs, bound):
    static = garbage_static(mask_size=8 * 3 * 64, device="meta")
    batch = spec.batch(device="meta", **kwargs)
    with DeviceOps() as ops:
        view = pad_into(static, batch, key, PAD_ROW, fill=5 if key.mode is VERIFY else 1)
    assert view.input_ids.device.type == "meta"
    assert ops.count <= bound, ops.ops


def test_a_large_block_goes_over_in_two_device_operations():
    """Static buffers over 64 KiB: only the key's columns go over (a strided destination)."""
    static = StaticInputs.allocate(8, 2048, "meta")
    assert static.block.numel() * 8 > 64 * 1024
    batch = EXTEND_PREFIX.batch(device="meta")
    with DeviceOps() as ops:
        pad_into(static, batch, GraphKey(EXTEND, 8, 0, token_bucket=16), PAD_ROW, 1)
    assert ops.ops == ["copy_", "strided copy kernel"]


def test_the_device_op_count_catches_device_work():
    """The counter itself: the old padding's per-field copies and fills are counted."""
    static, ids = garbage_static(device="meta"), torch.zeros(3, dtype=torch.int64, device="meta")
    with DeviceOps() as ops:
        static.input_ids[:3].copy_(ids)
        static.seq_lens[3:4].fill_(1)
        torch.zeros(3).add_(1)  # host: not counted
        static.positions[:3].copy_(torch.ones(3, dtype=torch.int64))  # host to a contiguous destination
    assert ops.ops == ["copy_", "fill_", "copy_"]
    with pytest.raises(RuntimeError, match="meta tensors"):  # a host read of a device value: a synchronization
        int(static.seq_lens[3])


def _triton_buffers(device):
    return GraphBuffers(8, 16, num_heads=2, v_dim=4, max_context_len=64, splits_for_bs=lambda bs: 1, device=device)


@pytest.mark.parametrize("key,capture,replay", [
    (GraphKey(EXTEND, 8, 0, token_bucket=16), Spec(EXTEND, [0] * 7, [10] + [1] * 6, [PAD_ROW] * 7), EXTEND_PREFIX),
    (GraphKey(DECODE, 4, 1), Spec(DECODE, [0] * 4, [1] * 4, [PAD_ROW] * 4), DECODE_3),
], ids=["extend", "decode"])
def test_triton_refresh_of_a_runner_replay_makes_no_device_operation(key, capture, replay):
    """Decode and extend graphs read the runner's static buffers (request rows, seq_lens; extend:
    extend_indptr, prefix lengths), which pad_into wrote: the refresh writes nothing. Before: 2
    (decode) and 1 (extend) copies per replay."""
    static, graph = garbage_static(device="meta"), _triton_buffers("meta")
    graph.capture(key, pad_into(static, capture.batch(device="meta"), key, PAD_ROW, 1))
    view = pad_into(static, replay.batch(device="meta"), key, PAD_ROW, 1)
    with DeviceOps() as ops:
        graph.refresh(key, view)
    assert ops.ops == []


def test_triton_extend_refresh_reads_the_runner_buffers():
    """An extend graph's attention metadata is the runner's request rows, extend_indptr and prefix
    lengths. A batch with other tensors (another runner's buffers) is copied in, from its host
    lengths or, without them, its device ones."""
    key = GraphKey(EXTEND, 8, 0, token_bucket=16)
    capture, replay = Spec(EXTEND, [0] * 7, [10] + [1] * 6, [PAD_ROW] * 7), EXTEND_PREFIX
    static, graph = garbage_static(), _triton_buffers("cpu")
    graph.capture(key, pad_into(static, capture.batch(), key, PAD_ROW, 1))
    meta = graph.refresh(key, pad_into(static, replay.batch(), key, PAD_ROW, 1))
    for name, buffer in [("req_pool_indices", static.req_pool_indices), ("qo_indptr", static.extend_indptr),
                         ("prefix_lens", static.extend_prefix_lens)]:
        assert getattr(meta, name).data_ptr() == buffer.data_ptr(), name
    want = expected(replay, key, 1)
    assert meta.req_pool_indices.tolist() == want["req_pool_indices"]
    assert meta.qo_indptr.tolist() == want["extend_indptr"] == [0, 3, 8, 10, 16, 16, 16, 16, 16]
    assert meta.prefix_lens.tolist() == want["extend_prefix_lens"]
    for host in (True, False):
        other = pad_into(garbage_static(), capture.batch(), key, PAD_ROW, 1)  # another runner's buffers
        other.extend_indptr = None
        if not host:  # and no host lengths: from the device ones
            other.extend_seq_lens_cpu = other.extend_prefix_lens_cpu = None
        meta = graph.refresh(key, other)
        assert meta.req_pool_indices.tolist() == [PAD_ROW] * 8 and meta.prefix_lens.tolist() == [0] * 8
        assert meta.qo_indptr.tolist() == [0, 10, 11, 12, 13, 14, 15, 16, 16]
        graph.refresh(key, pad_into(static, replay.batch(), key, PAD_ROW, 1))


def test_triton_decode_refresh_copies_another_batch_in():
    """A decode graph bound to the runner's buffers: a batch with tensors of its own is copied into them."""
    key = GraphKey(DECODE, 4, 1)
    static, graph = garbage_static(), _triton_buffers("cpu")
    meta = graph.capture(key, pad_into(static, Spec(DECODE, [0] * 4, [1] * 4, [PAD_ROW] * 4).batch(), key, PAD_ROW, 1))
    assert meta.req_pool_indices.data_ptr() == static.req_pool_indices.data_ptr()
    assert meta.seq_lens.data_ptr() == static.seq_lens.data_ptr()
    batch = Spec(DECODE, [4, 9, 2, 6], [1] * 4, [0, 2, 1, 3]).batch()
    meta = graph.refresh(key, batch)
    assert meta.req_pool_indices.tolist() == [0, 2, 1, 3] and meta.seq_lens.tolist() == [5, 10, 3, 7]


# -- on a GPU ------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("max_tokens", [512, 4096], ids=["whole-block", "key-columns"])
@pytest.mark.parametrize("name,spec,key,kwargs,bound", OP_BOUNDS, ids=[c[0] for c in OP_BOUNDS])
def test_padding_does_not_wait_for_the_device(max_tokens, name, spec, key, kwargs, bound):
    """pad_into returns while the stream is still busy (no synchronization, pageable staging
    included), and the buffers hold the expected values once the stream has run."""
    static = StaticInputs.allocate(8, max_tokens, "cuda", mask_size=8 * 3 * 64)
    batch, fill = spec.batch(device="cuda", **kwargs), 5 if key.mode is VERIFY else 1
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # about 0.1 s of device time queued ahead
    view = pad_into(static, batch, key, PAD_ROW, fill)
    assert not torch.cuda.current_stream().query(), "pad_into waited for the device"
    torch.cuda.synchronize()
    check(view, expected(spec, key, fill))
