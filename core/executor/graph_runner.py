"""CUDA-graph capture and replay for whatever plugin combination is configured.

At startup the runner asks the active plugins which modes they can run inside a graph, captures
one graph per GraphKey (mode, padded batch size, tokens per request, plugin extras), largest batch
first, all in the process's one graph memory pool, and afterwards replays them: pad the real
batch to the next captured size on the host (padded requests read slot 0 with the backend's
seq_len fill value and write to the dump slot 0) and copy it into the static buffers in one copy,
refresh the backend's metadata in place, replay, slice the output back.
"""

from __future__ import annotations

import logging
import sys
import time
from array import array
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING, Any, Callable

import torch

from backplane.contracts.batch import ForwardBatch, ForwardMode, HostBatch, host_bytes
from backplane.contracts.forward_context import ForwardContext
from backplane.executor.graph_sizes import (GraphKey, capture_batch_sizes, combine_variants, extend_batch_sizes,
                                            extend_shape, extend_token_buckets, padded_size, tokens_per_request)
from backplane.contracts.model import ModelOutput
from backplane.models.base import ModelContext
from backplane.executor.compiled import CompiledForward
from backplane.executor.piecewise import capture_piecewise, release_allocator_caches

if TYPE_CHECKING:
    from backplane.contracts.attention import AttentionBackend
    from backplane.contracts.memory import ReqToTokenPool, TokenToKVPool
    from backplane.contracts.protocols import GraphContributor
    from backplane.plugin.selection import Selection
    from backplane.config import GraphConfig

logger = logging.getLogger(__name__)

_GRAPH_POOL = None  # NOTE: one pool per process by design (shared by target and draft runners)


def global_graph_pool():
    """The process-wide CUDA graph memory pool every runner captures into.

    The pool is a `torch.cuda.MemPool` held here for the life of the process, so it outlives any
    one runner: a bare `graph_pool_handle()` pool dies with the last graph captured into it, and a
    later capture under the same handle (a runner built after another was freed) then trips the
    caching allocator's pool reference count.
    """
    global _GRAPH_POOL
    if _GRAPH_POOL is None:
        _GRAPH_POOL = torch.cuda.MemPool()
    return _GRAPH_POOL.id


def _free_after_releasing_cache() -> int:
    """Free device memory once the allocators' unused cache is returned (graph pools stay held)."""
    release_allocator_caches()
    return torch.cuda.mem_get_info()[0]


def pool_bytes(pool) -> int:
    """Bytes of device memory the caching allocator holds in the graph pool `pool` (an id tuple).

    What capturing into a pool costs is its growth: memory reused from blocks that earlier
    captures freed does not count, nor does anything outside the pool (warm-up caches, library
    workspaces, other processes on the device).
    """
    pool = tuple(pool)
    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
               if tuple(seg.get("segment_pool_id", (0, 0))) == pool)


class GraphCaptureError(RuntimeError):
    pass


def capture_graph(fn: Callable[[], Any], pool: Any = None, warmup: int = 2) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Run `fn` `warmup` times, then capture one call of it into a CUDA graph in memory pool `pool`
    (None: a private pool). Returns the graph and what the captured call returned: the static
    outputs that every replay overwrites."""
    for _ in range(warmup):  # allocator, autotuning, lazy initialisation
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = fn()
    torch.cuda.synchronize()
    return graph, output


class RerunGraph:
    """A stand-in for a captured CUDA graph that re-runs the captured Python at every replay and
    writes its output into the first run's tensors, as a replay overwrites the static outputs. For
    tests on CPU (`GraphRunner.capture_fn = rerun_capture`): everything a replay depends on (the
    static buffers, the padding, the backends' and contributors' graph metadata refreshed in place)
    is exercised; only the recording itself is not."""

    def __init__(self, fn: Callable[[], Any], output: Any):
        self.fn, self.output = fn, output

    def replay(self) -> None:
        new = self.fn()
        for mine, fresh in zip(_tensors(self.output), _tensors(new)):
            if mine.data_ptr() != fresh.data_ptr():
                mine.copy_(fresh)


def _tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, ModelOutput):
        return [t for t in (output.logits, output.hidden_states) if t is not None]
    return [t for t in output if isinstance(t, torch.Tensor)]


def rerun_capture(fn: Callable[[], Any], pool: Any = None, warmup: int = 1) -> tuple[RerunGraph, Any]:
    """`capture_graph`'s signature on any device: warm up, run once, return a RerunGraph and its output."""
    for _ in range(warmup):
        fn()
    output = fn()
    return RerunGraph(fn, output), output


# The rows of StaticInputs.block; a replay's host tensor has the same layout (`pad_into`).
# Rows SEQ, PREFIX and NEW hold int32 values: their first max_bs int32 are the buffers; row
# EXTEND_INDPTR too: its first max_bs + 1 int32.
_IDS, _POSITIONS, _SLOTS, _ROWS, _LOGITS, _INDPTR, _SEQ, _PREFIX, _NEW, _EXTEND_INDPTR = range(10)
_NUM_ROWS = 10
# A block of at most this many bytes goes over whole at every replay: one contiguous copy. The first
# columns of a larger one are a strided destination, which a copy reaches through a staging tensor
# and a device kernel (two device operations).
_WHOLE_BLOCK_BYTES = 64 * 1024
# The byte of an int64 that holds its sign (a negative input id is a placeholder).
_SIGN_BYTE = 7 if sys.byteorder == "little" else 0


@dataclass(frozen=True)
class PaddedViews:
    """The static buffers' views for the graphs of one padded shape (batch_size requests,
    num_tokens tokens), and `dst`: the block's first `width` columns, which their replays overwrite
    (flat when they are the whole block: a flat host tensor goes over with no view of it made)."""

    width: int
    dst: torch.Tensor  # [10, width] int64, or [10 * width] when width is the block's
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor  # [batch_size]
    seq_lens: torch.Tensor
    extend_prefix_lens: torch.Tensor
    extend_seq_lens: torch.Tensor
    logits_indices: torch.Tensor
    mask_indptr: torch.Tensor  # [batch_size + 1]
    extend_indptr: torch.Tensor  # [batch_size + 1] int32


class StaticInputs:
    """The buffers captured graphs read: rows of ONE int64 block, so that a replay writes all of
    them with one host-to-device copy (`pad_into`).

    block: [10, width] int64, width = max(max_tokens, max_bs + 1); each buffer is (part of) a row:
      input_ids, positions, out_cache_loc: [max_tokens] int64 (rows 0-2)
      req_pool_indices: [max_bs] int64 (row 3)
      logits_indices: [max_bs] int64 (row 4), EXTEND: the last new token of each request
      mask_indptr: [max_bs + 1] int64 (row 5), TARGET_VERIFY
      seq_lens, extend_prefix_lens, extend_seq_lens: [max_bs] int32, the first max_bs int32 of rows
        6-8 (extend lengths: TARGET_VERIFY and EXTEND)
      extend_indptr: [max_bs + 1] int32, the first max_bs + 1 int32 of row 9, EXTEND: 0, then the
        running sum of extend_seq_lens (the padded batch's `extend_indptr`, which an attention
        backend reads instead of computing it at every replay)
    custom_mask: [mask_size] bool, TARGET_VERIFY's tree mask (see ForwardBatch),
      mask_size = max_bs * tokens_per_request * max_context_len.
    """

    def __init__(self, max_bs: int, max_tokens: int, device, mask_size: int = 0):
        self.max_bs, self.max_tokens = max_bs, max_tokens
        self.block = torch.zeros((_NUM_ROWS, max(max_tokens, max_bs + 1)), dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.out_cache_loc = self.block[:_ROWS, :max_tokens].unbind()
        self.req_pool_indices, self.logits_indices = self.block[_ROWS:_INDPTR, :max_bs].unbind()
        self.mask_indptr = self.block[_INDPTR, : max_bs + 1]
        lens = self.block[_SEQ:_EXTEND_INDPTR].view(torch.int32)[:, :max_bs]  # [3, max_bs] int32
        self.seq_lens, self.extend_prefix_lens, self.extend_seq_lens = lens.unbind()
        self.extend_indptr = self.block[_EXTEND_INDPTR].view(torch.int32)[: max_bs + 1]
        self.custom_mask = torch.zeros(mask_size, dtype=torch.bool, device=device)
        self._views: dict[tuple[int, int], PaddedViews] = {}
        self._padding: dict[tuple, bytes] = {}

    @classmethod
    def allocate(cls, max_bs: int, max_tokens: int, device, mask_size: int = 0) -> StaticInputs:
        return cls(max_bs, max_tokens, device, mask_size)

    def views(self, batch_size: int, num_tokens: int) -> PaddedViews:
        """The views for graphs of `batch_size` requests and `num_tokens` tokens (made once)."""
        views = self._views.get((batch_size, num_tokens))
        if views is None:
            views = self._views[(batch_size, num_tokens)] = self._new_views(batch_size, num_tokens)
        return views

    def padding(self, key: GraphKey, pad_row: int, fill: int) -> torch.Tensor:
        """[10, width] int64 on the host, laid out as `block`: what every replay of `key` starts from,
        its requests all padding (row `pad_row`; seq_len `fill` under a uniform key, 0 under an extend
        one; a verify's tokens_per_request new tokens each), its tokens id, position and slot 0. A
        fresh tensor of `padding_bytes`."""
        data = bytearray(self.padding_bytes(key, pad_row, fill))
        return torch.frombuffer(data, dtype=torch.int64).view(_NUM_ROWS, -1)

    def padding_bytes(self, key: GraphKey, pad_row: int, fill: int) -> bytes:
        """`padding`'s bytes, made once per key shape; a replay starts from a copy of them (`pad_into`)."""
        verify = key.mode is ForwardMode.TARGET_VERIFY
        cached = (key.batch_size, key.num_tokens, key.ragged, verify and key.tokens_per_request, pad_row, fill)
        padding = self._padding.get(cached)
        if padding is None:
            pbs = key.batch_size
            rows = torch.zeros((_NUM_ROWS, self.views(pbs, key.num_tokens).width), dtype=torch.int64)
            rows[_ROWS, :pbs] = pad_row
            lens = rows[_SEQ:_EXTEND_INDPTR].view(torch.int32)
            lens[0, :pbs] = 0 if key.ragged else fill
            lens[2, :pbs] = key.tokens_per_request if verify else 0
            padding = self._padding[cached] = host_bytes(rows, torch.int64)
        return padding

    def _new_views(self, bs: int, n: int) -> PaddedViews:
        if bs > self.max_bs or n > self.max_tokens:
            raise ValueError(f"graph runner: expected a graph of at most {self.max_bs} requests and "
                             f"{self.max_tokens} tokens (the static buffers), got {bs} requests x {n} tokens")
        whole = self.block.numel() * self.block.element_size() <= _WHOLE_BLOCK_BYTES
        width = self.block.shape[1] if whole else max(n, bs + 1)
        dst = self.block.view(-1) if whole else self.block[:, :width]
        return PaddedViews(width, dst, self.input_ids[:n], self.positions[:n], self.out_cache_loc[:n],
                           self.req_pool_indices[:bs], self.seq_lens[:bs], self.extend_prefix_lens[:bs],
                           self.extend_seq_lens[:bs], self.logits_indices[:bs], self.mask_indptr[: bs + 1],
                           self.extend_indptr[: bs + 1])


def pad_into(static: StaticInputs, batch: ForwardBatch, key: GraphKey, pad_row: int, fill: int) -> ForwardBatch:
    """Copy `batch` into the static buffers padded to `key`, and return the padded batch view.

    Uniform keys: padded requests use request row `pad_row` (all zeros: slot 0), seq_len `fill`, and
    write their K/V to the dump slot 0. Ragged (extend) keys: see `_pad_extend`.

    The padded content is built on the host (the real batch over a copy of the key's padding,
    `StaticInputs.padding_bytes`) and goes over in one non-blocking copy; after it, on the device,
    only what the host lacks (`_fill_real`) and a verify's tree mask. Nothing waits for the device.
    The host block is Python bytes until its one tensor (`_HostBlock`): every torch operator costs
    host time, and with the batch's host copies the padding makes one, the copy.
    """
    pbs = key.batch_size
    views = static.views(pbs, key.num_tokens)
    block = _HostBlock(static.padding_bytes(key, pad_row, fill), views.width)  # fresh: see the NOTE below
    from_device = _fill_real(block, batch)
    if key.ragged:
        _pad_extend(block, batch, key)
    mask = _pad_verify(block, batch, key) if key.mode is ForwardMode.TARGET_VERIFY else None
    # NOTE: `block` is fresh and nothing writes it after this copy (the padded batch keeps tensors
    # over it as its host copies), so the copy may complete after we return: a pageable source is
    # staged by the copy itself.
    host = block.tensor()
    views.dst.copy_(host if views.dst.dim() == 1 else host.view(_NUM_ROWS, views.width), non_blocking=True)
    for name, tensor in from_device:  # after the block copy in stream order: overwrites its zeros
        getattr(static, name)[: tensor.shape[0]].copy_(tensor)
    view = _view(views, key, batch, block.int32_tensor(_SEQ, pbs))
    if key.ragged or mask is not None:
        view.extend_prefix_lens, view.extend_seq_lens = views.extend_prefix_lens, views.extend_seq_lens
        view.extend_prefix_lens_cpu = block.int32_tensor(_PREFIX, pbs)
        view.extend_seq_lens_cpu = block.int32_tensor(_NEW, pbs)
    if key.ragged:
        view.logits_indices, view.extend_indptr = views.logits_indices, views.extend_indptr
    if mask is not None:
        _copy_mask(static, view, batch.custom_mask, *mask)
        view.mask_indptr = views.mask_indptr
    return view


class _HostBlock:
    """A replay's host block, laid out as StaticInputs.block over `width` columns, as a bytearray:
    written by Python (values as bytes, `put`), then made one tensor (`tensor`) and, for the padded
    batch's host copies, tensors over its int32 rows (`int32_tensor`): no torch operator but the copy."""

    __slots__ = ("data", "memory", "width")

    def __init__(self, padding: bytes, width: int):
        self.data = bytearray(padding)
        self.memory = memoryview(self.data)
        self.width = width

    def put(self, row: int, values: bytes, col: int = 0, itemsize: int = 8) -> None:
        """Row `row`'s elements of `itemsize` bytes (8: int64; 4: an int32 row) from column `col`."""
        start = 8 * row * self.width + itemsize * col
        if itemsize * col + len(values) > 8 * self.width:
            raise ValueError(f"graph runner: expected at most {8 * self.width // itemsize - col} values for row "
                             f"{row} from column {col}, got {len(values) // itemsize}")
        self.memory[start:start + len(values)] = values

    def put32(self, row: int, values: bytes, col: int = 0) -> None:
        self.put(row, values, col, itemsize=4)

    def ints32(self, row: int, count: int) -> list[int]:
        """The first `count` int32 of row `row`."""
        start = 8 * row * self.width
        return self.memory[start:start + 4 * count].cast("i").tolist()

    def int32_tensor(self, row: int, count: int) -> torch.Tensor:
        """[count] int32 over the first `count` of row `row` (shares the block's memory)."""
        return torch.frombuffer(self.data, dtype=torch.int32, count=count, offset=8 * row * self.width)

    def tensor(self) -> torch.Tensor:
        """[10 * width] int64 over the block (shares its memory)."""
        return torch.frombuffer(self.data, dtype=torch.int64)


def _fill_real(block: _HostBlock, batch: ForwardBatch) -> list[tuple[str, torch.Tensor]]:
    """Write `batch`'s tokens, request rows and seq_lens into `block` from its host copies
    (`batch.host`, `seq_lens_cpu`, read as bytes: `host_bytes`); returns the (static buffer, device
    tensor) pairs to copy on the device instead: all of them for a batch without host copies
    (capture, speculative drafts, tensor-parallel workers), the input ids when they hold
    placeholders that the device resolved (overlap scheduling)."""
    n, bs = batch.num_tokens, batch.batch_size
    block.put32(_SEQ, host_bytes(batch.seq_lens_cpu, torch.int32))  # the padded batch's seq_lens_cpu either way
    copies = batch.host
    if copies is None or copies.input_ids.shape[0] != n or copies.req_pool_indices.shape[0] != bs:
        return [("input_ids", batch.input_ids), ("positions", batch.positions), ("out_cache_loc", batch.out_cache_loc),
                ("req_pool_indices", batch.req_pool_indices), ("seq_lens", batch.seq_lens)]
    block.put(_POSITIONS, host_bytes(copies.positions, torch.int64))
    block.put(_SLOTS, host_bytes(copies.out_cache_loc, torch.int64))
    block.put(_ROWS, host_bytes(copies.req_pool_indices, torch.int64))
    ids = host_bytes(copies.input_ids, torch.int64)
    if not ids[_SIGN_BYTE::8].isascii():  # a sign bit set: some id is negative, a placeholder (HostBatch)
        return [("input_ids", batch.input_ids)]
    block.put(_IDS, ids)
    return []


def extend_lens_cpu(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(prefix lengths, new-token lengths) of an extend batch, [batch_size] int32 host tensors."""
    return tuple(torch.frombuffer(bytearray(lens), dtype=torch.int32) if lens else torch.zeros(0, dtype=torch.int32)
                 for lens in _extend_lens(batch))


def _extend_lens(batch: ForwardBatch) -> tuple[bytes, bytes]:
    """`extend_lens_cpu` as the bytes of [batch_size] int32, from the batch's host tensors by no
    torch operator (prefix lengths: seq_lens - new tokens when the batch has none)."""
    if batch.extend_seq_lens_cpu is None:
        raise ValueError(f"graph runner: an extend graph batch needs extend_seq_lens_cpu, got None "
                         f"({batch.forward_mode.value}, {batch.batch_size} requests)")
    new = host_bytes(batch.extend_seq_lens_cpu, torch.int32)
    if batch.extend_prefix_lens_cpu is not None:
        return host_bytes(batch.extend_prefix_lens_cpu, torch.int32), new
    seq = memoryview(host_bytes(batch.seq_lens_cpu, torch.int32)).cast("i")
    return array("i", [s - k for s, k in zip(seq, memoryview(new).cast("i"))]).tobytes(), new


def _pad_extend(block: _HostBlock, batch: ForwardBatch, key: GraphKey) -> None:
    """Pad an extend batch of bs requests and n new tokens to key.batch_size requests and
    key.token_bucket tokens: request bs (row `pad_row`, no prefix) takes the bucket's n..T tokens
    (position 0, K/V to the dump slot 0), further padded requests have none; every padded
    request's logits row reads token 0 and is dropped at replay. Writes `block`'s extend lengths
    from the batch's host ones, each real request's logits row (its last new token) and the
    padded batch's `extend_indptr`: prefix sums in Python, a batch being a few requests.
    """
    bs, n = batch.batch_size, batch.num_tokens
    pbs, pn = key.batch_size, key.num_tokens
    if n > pn or bs > pbs or (n < pn and bs == pbs):
        raise ValueError(f"graph runner: an extend batch of {bs} requests and {n} tokens does not fit graph "
                         f"{pbs} requests x {pn} tokens (a padded request needs a slot)")
    prefix, new = _extend_lens(batch)
    block.put32(_PREFIX, prefix)
    block.put32(_NEW, new)
    if pbs > bs:  # the padded request's seq_len: its new tokens; the others' stay 0
        spare = array("i", [pn - n]).tobytes()
        block.put32(_SEQ, spare, bs)
        block.put32(_NEW, spare, bs)
    ends = list(accumulate(memoryview(new).cast("i")))  # each real request's end in the tokens
    block.put(_LOGITS, array("q", [end - 1 for end in ends]).tobytes())
    block.put32(_EXTEND_INDPTR, array("i", ends + [pn] * (pbs - bs)).tobytes(), 1)  # [0] = 0


def _pad_verify(block: _HostBlock, batch: ForwardBatch, key: GraphKey) -> tuple[int, int]:
    """The verify fields of a padded batch, into `block`: extend lengths from seq_lens, and the mask's
    indptr with an all-visible [tokens_per_request, seq_len] block for each padded request. Returns
    (mask entries of the real requests, of all of them)."""
    if batch.custom_mask is None:
        raise ValueError("graph runner: a TARGET_VERIFY batch needs custom_mask, got None")
    pbs, tpr = key.batch_size, key.tokens_per_request
    seq = block.ints32(_SEQ, pbs)  # extend lengths: tpr, from the padding
    block.put32(_PREFIX, array("i", [s - tpr for s in seq]).tobytes())
    ends = [0, *accumulate(tpr * s for s in seq)]  # tpr * seq_len mask entries per request
    block.put(_INDPTR, array("q", ends).tobytes())
    return ends[batch.batch_size], ends[pbs]


def _copy_mask(static: StaticInputs, view: ForwardBatch, real_mask: torch.Tensor, real: int, total: int) -> None:
    """The real requests' tree mask, then all-visible entries for the padded ones (on the device)."""
    if total > static.custom_mask.numel():
        raise ValueError(f"graph runner: expected a verify mask of at most {static.custom_mask.numel()} entries, "
                         f"got {total}")
    if real:
        static.custom_mask[:real].copy_(real_mask.view(-1)[:real])
    if total > real:
        static.custom_mask[real:total].fill_(True)
    view.custom_mask = static.custom_mask[:total]


def _view(views: PaddedViews, key: GraphKey, like: ForwardBatch, seq_lens_cpu: torch.Tensor) -> ForwardBatch:
    return ForwardBatch(
        forward_mode=key.mode, batch_size=key.batch_size, input_ids=views.input_ids, positions=views.positions,
        req_pool_indices=views.req_pool_indices, seq_lens=views.seq_lens, seq_lens_cpu=seq_lens_cpu,
        out_cache_loc=views.out_cache_loc, req_to_token_pool=like.req_to_token_pool,
        token_to_kv_pool=like.token_to_kv_pool, spec_info=like.spec_info, plugin_inputs=dict(like.plugin_inputs),
    )


@dataclass(frozen=True)
class GraphRunnerContext:
    """What a GraphRunner reads from its model runner (`ModelRunner.graph_context()`).

    model, model_ctx: the model whose forward is captured and its context (each capture binds a
    ForwardContext on it); attn_backend: the backend the graphs' attention runs (graph state, capture and replay
    metadata); attention: the decode backend's selection (its seq_len fill value for padded
    requests; named when a capture fails); config: the graph settings (--cuda-graph-*, torch.compile,
    the draft-token count); contributors: the runner's graph contributors, which key every graph
    and bind their state for capture and replay.
    """

    model: torch.nn.Module
    model_ctx: ModelContext
    attn_backend: AttentionBackend
    attention: Selection
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: TokenToKVPool
    device: torch.device
    config: GraphConfig
    contributors: tuple[GraphContributor, ...] = ()


class GraphRunner:
    """Captures and replays the graphs of one model runner: uniform ones (decode, verify, draft
    windows) at padded batch sizes, and extend ones (EXTEND, prefill and extend over a cached
    prefix) at (request slots, token bucket) shapes.

    modes: the modes to capture, with how ("full" or "piecewise"; a list of modes means full).
    extras_variants: the graph-key extras to capture each size for; by default every combination
    of the contributors' `graph_variants()`.
    """

    def __init__(self, ctx: GraphRunnerContext, modes: list[ForwardMode] | dict[ForwardMode, str],
                 extras_variants: list[tuple] | None = None):
        self.ctx = ctx
        self.model = ctx.model
        self.backend = ctx.attn_backend
        self.fill = ctx.attention.spec.seq_len_fill_value
        self.pad_row = ctx.req_to_token_pool.size - 1
        self.sizes, self.compile_sizes = capture_batch_sizes(ctx.config, self.pad_row)
        self.kinds = dict(modes) if isinstance(modes, dict) else {m: "full" for m in modes}
        self.modes = list(self.kinds)
        uniform = [m for m in self.modes if m is not ForwardMode.EXTEND]
        self.tokens_per_request = {m: tokens_per_request(ctx.config, m) for m in uniform}
        self.extras_variants = extras_variants or combine_variants([c.graph_variants() for c in ctx.contributors])
        max_bs = max(self.sizes) if uniform else 1
        max_tokens = max_bs * max(self.tokens_per_request.values(), default=1)
        self.extend_buckets: list[int] = []
        self.extend_sizes: list[int] = []
        if ForwardMode.EXTEND in self.kinds:
            self.extend_buckets = extend_token_buckets(ctx.config.cuda_graph_max_tokens)
            limit = min(ctx.config.cuda_graph_max_extend_bs, self.pad_row)  # requests + the padded one
            self.extend_sizes = extend_batch_sizes(max(limit, 1))
            max_bs, max_tokens = max(max_bs, max(self.extend_sizes)), max(max_tokens, max(self.extend_buckets))
        verify_tpr = self.tokens_per_request.get(ForwardMode.TARGET_VERIFY, 0)
        mask_size = max_bs * verify_tpr * ctx.req_to_token_pool.max_context_len
        self.static = StaticInputs.allocate(max_bs, max_tokens, ctx.device, mask_size)
        if "full" in self.kinds.values():  # piecewise modes plan eagerly: no static metadata
            self.backend.init_graph_state(max_bs, max_tokens)
        # Every graph writes its fp32 logits into views of this one buffer (only one graph replays at
        # a time): kept outputs of their own would hold a [tokens, vocab] tensor per graph in the pool,
        # and the draft runners capturing later could reuse none of it. Extend graphs need a row per
        # request only.
        logit_rows = max(max(self.sizes) * max(self.tokens_per_request.values(), default=0), max(self.extend_sizes, default=0))
        self.static_logits = torch.empty((logit_rows, self.model.vocab_size), dtype=torch.float32,
                                         device=ctx.device)
        # None: capture_graph (a CUDA graph); tests on CPU set rerun_capture.
        self.capture_fn: Callable[..., tuple[Any, Any]] | None = None
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.compiled: CompiledForward | None = None
        self.outputs: dict[GraphKey, ModelOutput] = {}
        self.capture_seconds = 0.0
        self.graph_memory_bytes = 0  # growth of the graph pool during capture
        self.device_memory_bytes = 0  # drop of the device's free memory during capture (all causes)

    def keys(self) -> list[GraphKey]:
        """Every key to capture, extend graphs first (their largest buckets set the pool's size, so
        the smaller graphs after them reuse its blocks), each mode's largest shapes first."""
        keys = [self.extend_key(bs, bucket, extras) for extras in self.extras_variants
                for bucket in reversed(self.extend_buckets) for bs in reversed(self.extend_sizes) if bs <= bucket]
        return keys + [GraphKey(mode, bs, self.tokens_per_request[mode], extras, capture=self.kinds[mode])
                       for mode in self.modes if mode is not ForwardMode.EXTEND
                       for extras in self.extras_variants for bs in reversed(self.sizes)]

    def extend_key(self, batch_size: int, bucket: int, extras: tuple) -> GraphKey:
        return GraphKey(ForwardMode.EXTEND, batch_size, 0, extras, token_bucket=bucket,
                        capture=self.kinds[ForwardMode.EXTEND])

    # -- capture --------------------------------------------------------------------------------

    def capture(self) -> None:
        from tqdm import tqdm

        keys = self.keys()
        cuda = self.ctx.device.type == "cuda"  # else a re-running stand-in (tests): nothing to measure
        free_before = _free_after_releasing_cache() if cuda else 0
        pool_before = pool_bytes(global_graph_pool()) if cuda else 0
        start = time.perf_counter()
        for key in tqdm(keys, desc="capturing CUDA graphs", leave=False, disable=not sys.stderr.isatty()):
            try:
                self._capture_one(key)
            except Exception as exc:
                raise GraphCaptureError(self._failure_message(key, exc)) from exc
        if cuda:
            torch.cuda.synchronize()
            self.device_memory_bytes = free_before - _free_after_releasing_cache()
            self.graph_memory_bytes = pool_bytes(global_graph_pool()) - pool_before
        self.capture_seconds = time.perf_counter() - start
        extend = (f", extend token buckets {self.extend_buckets} x up to {max(self.extend_sizes)} requests "
                  f"({self.kinds[ForwardMode.EXTEND]})" if self.extend_buckets else "")
        logger.info("captured %d CUDA graphs (batch sizes %s%s) in %.1f s: graph pool +%.0f MB (device %.0f MB)",
                    len(keys), self.sizes, extend, self.capture_seconds, self.graph_memory_bytes / 2**20,
                    self.device_memory_bytes / 2**20)

    def fill_for(self, key: GraphKey) -> int:
        """seq_len of padded requests: the backend's value, but at least the new tokens of a verify."""
        if key.mode is ForwardMode.TARGET_VERIFY:
            return max(self.fill, key.tokens_per_request)
        return self.fill

    def _capture_batch(self, key: GraphKey) -> ForwardBatch:
        """The batch a graph of `key` is captured with, padded into the static buffers: a uniform
        key's requests are all padding; an extend key's key.batch_size requests share the bucket's
        tokens (one request the rest, every other one token; no prefix), all on row pad_row."""
        bs, n = key.batch_size, key.num_tokens
        lens = [n - (bs - 1)] + [1] * (bs - 1) if key.ragged else []
        like = self._host_built_batch(key.mode, lens)
        if key.mode is ForwardMode.TARGET_VERIFY:  # capture with a mask: replays always carry one
            like.custom_mask = self.static.custom_mask[:0]
        return pad_into(self.static, like, key, self.pad_row, self.fill_for(key))

    def _host_built_batch(self, mode: ForwardMode, lens: list[int]) -> ForwardBatch:
        """Requests of `lens` new tokens (no prefix) on row pad_row, token ids and slots 0, with
        host copies as the batch builder makes them."""
        n, bs, device = sum(lens), len(lens), self.ctx.device
        zeros = torch.zeros(n, dtype=torch.int64)
        positions = torch.cat([torch.arange(k) for k in lens]) if lens else zeros
        rows = torch.full((bs,), self.pad_row, dtype=torch.int64)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        like = ForwardBatch(forward_mode=mode, batch_size=bs, input_ids=zeros.to(device), positions=positions.to(device),
                            req_pool_indices=rows.to(device), seq_lens=seq_lens.to(device), seq_lens_cpu=seq_lens,
                            out_cache_loc=zeros.to(device), req_to_token_pool=self.ctx.req_to_token_pool,
                            token_to_kv_pool=self.ctx.token_to_kv_pool,
                            host=HostBatch(input_ids=zeros, positions=positions, out_cache_loc=zeros, req_pool_indices=rows))
        if mode is ForwardMode.EXTEND:
            like.extend_prefix_lens_cpu, like.extend_seq_lens_cpu = torch.zeros(bs, dtype=torch.int32), seq_lens
        return like

    def _capture_one(self, key: GraphKey) -> None:
        batch = self._capture_batch(key)
        if key.capture == "piecewise":
            return self._capture_piecewise(key, batch)
        self.backend.init_metadata_for_capture(key, batch)
        forward, ops = self._forward_fn(key)
        # NOTE: bound once for the warm-up runs and the capture (they run the same batch); a replay
        # runs no Python, so nothing is bound then. Verify and extend graphs return the hidden
        # states (EAGLE drafts from them; harmless for other algorithms).
        context = ForwardContext(batch=batch, attn_backend=self.backend, ops=ops,
                                 bindings=self.prepare_contributors(batch, key),
                                 capture_hidden=key.mode in (ForwardMode.TARGET_VERIFY, ForwardMode.EXTEND),
                                 logits_out=self.static_logits, graph_key=key)

        def run():
            with self.ctx.model_ctx.bind(context):
                return forward(batch)

        pool = global_graph_pool() if self.ctx.device.type == "cuda" else None
        self.graphs[key], self.outputs[key] = (self.capture_fn or capture_graph)(run, pool)

    def _capture_piecewise(self, key: GraphKey, batch: ForwardBatch) -> None:
        """Capture `key` in segments around the attention calls (backplane.executor.piecewise); the
        backend plans eagerly, here for the capture batch and at every replay for the padded one."""
        if self.ctx.device.type != "cuda" or self.capture_fn is not None:
            raise GraphCaptureError(f"piecewise capture of {key} needs a CUDA device and real CUDA graphs")
        self.backend.init_forward_metadata(batch)
        bindings = self.prepare_contributors(batch, key)
        ops = self.ctx.model_ctx.default_ops

        def run(attn_backend):
            context = ForwardContext(batch=batch, attn_backend=attn_backend, ops=ops, bindings=bindings,
                                     capture_hidden=key.mode in (ForwardMode.TARGET_VERIFY, ForwardMode.EXTEND),
                                     logits_out=self.static_logits, graph_key=key)
            with self.ctx.model_ctx.bind(context):
                return self.model(batch)

        self.graphs[key], self.outputs[key] = capture_piecewise(run, self.backend, global_graph_pool())

    def _forward_fn(self, key: GraphKey):
        """(what a graph of `key` records, with which op table): the model, or its torch.compile
        (uniform graphs at the compiled batch sizes; extend graphs run the model as an eager
        extend does)."""
        ops = self.ctx.model_ctx.default_ops
        if key.ragged or key.batch_size not in self.compile_sizes:
            return self.model, ops
        if self.compiled is None:  # one torch.compile, one specialisation per captured shape
            self.compiled = CompiledForward(self.model, dynamic=False)
        return self.compiled, self.compiled.compile_ops(ops)

    def _failure_message(self, key: GraphKey, exc: Exception) -> str:
        choice = self.ctx.attention
        config = self.ctx.config
        remedies = [f"lower --cuda-graph-max-bs (now {config.cuda_graph_max_bs})",
                    f"lower --mem-fraction-static (now {config.mem_fraction_static})", "--disable-cuda-graph"]
        if config.enable_torch_compile:
            remedies.append("drop --enable-torch-compile")
        if key.ragged:
            remedies.insert(0, f"lower --cuda-graph-max-tokens (now {config.cuda_graph_max_tokens}) or pass "
                               "--disable-extend-graph")
        shape = f"{key.batch_size} requests x {key.token_bucket} tokens" if key.ragged else f"batch size {key.batch_size}"
        return (f"CUDA graph capture failed at {shape} ({key.mode.value}, attention "
                f"backend {choice.spec.name!r} of plugin {choice.plugin!r}): {type(exc).__name__}: {exc}. "
                f"Remedies: {'; '.join(remedies)}")

    # -- contributors ---------------------------------------------------------------------------

    def key_extras(self, batch: ForwardBatch) -> tuple:
        """The contributors' items of the key of `batch`'s graph, in contributor order."""
        return tuple(item for c in self.ctx.contributors for item in c.graph_key_extras(batch))

    def prepare_contributors(self, batch: ForwardBatch, key: GraphKey, real: ForwardBatch | None = None) -> dict:
        """Let every contributor write its per-batch state (LoRA segments) into its static buffers
        for capture or replay; returns their bindings (what a capture's ForwardContext binds)."""
        bindings: dict = {}
        for contributor in self.ctx.contributors:
            bindings.update(contributor.prepare_graph_batch(batch, key, real))
        return bindings

    # -- replay ---------------------------------------------------------------------------------

    def key_for(self, batch: ForwardBatch, capture_hidden: bool = False) -> GraphKey | None:
        """The key of the captured graph that can replay `batch`, or None (eager). Only verify graphs
        return hidden states, so a forward that wants them in another mode runs eagerly."""
        if batch.forward_mode not in self.modes:
            return None
        if batch.forward_mode is ForwardMode.EXTEND:
            return self._extend_key_for(batch)
        if capture_hidden and batch.forward_mode is not ForwardMode.TARGET_VERIFY:
            return None
        tpr = self.tokens_per_request[batch.forward_mode]
        if batch.num_tokens != batch.batch_size * tpr:
            return None
        bs = padded_size(batch.batch_size, self.sizes, allow_padding=not self.ctx.config.disable_cuda_graph_padding)
        if bs is None:
            return None
        key = GraphKey(batch.forward_mode, bs, tpr, self.key_extras(batch))
        return key if key in self.graphs else None

    def _extend_key_for(self, batch: ForwardBatch) -> GraphKey | None:
        """An extend batch replays when its tokens fit a bucket and its requests (plus the padded
        one) the slots, with the default logits rows and no custom mask."""
        if batch.logits_indices is not None or batch.custom_mask is not None or batch.extend_seq_lens_cpu is None:
            return None
        shape = extend_shape(batch.num_tokens, batch.batch_size, self.extend_buckets, self.extend_sizes)
        if shape is None:
            return None
        key = self.extend_key(*shape, self.key_extras(batch))
        return key if key in self.graphs else None

    def can_run(self, batch: ForwardBatch) -> bool:
        return self.key_for(batch) is not None

    def replay(self, batch: ForwardBatch, key: GraphKey | None = None) -> ModelOutput:
        """Replay the graph of `key` (default: `key_for(batch)`) for `batch`; its output sliced back."""
        key = key or self.key_for(batch)
        padded = pad_into(self.static, batch, key, self.pad_row, self.fill_for(key))
        self.prepare_contributors(padded, key, real=batch)
        if key.capture == "piecewise":  # the attention between the segments plans and runs eagerly
            self.backend.init_forward_metadata(padded)
            self.graphs[key].replay(padded)
        else:
            self.backend.init_metadata_for_replay(key, padded)
            self.graphs[key].replay()
        out = self.outputs[key]
        n = batch.num_tokens
        rows = batch.batch_size if key.ragged else n  # extend: one logits row per request
        hidden = out.hidden_states[:n] if out.hidden_states is not None else None
        return ModelOutput(logits=out.logits[:rows], hidden_states=hidden)
