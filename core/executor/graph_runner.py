"""CUDA-graph capture and replay for whatever plugin combination is configured.

At startup the runner asks the active plugins which modes they can run inside a graph, captures
one graph per GraphKey (mode, padded batch size, tokens per request, plugin extras), largest batch
first, all in the process's one graph memory pool, and afterwards replays them: copy the real
batch into static buffers, pad to the next captured size (padded requests read slot 0 with the
backend's seq_len fill value and write to the dump slot 0), refresh the backend's metadata in
place, replay, slice the output back.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from backplane.contracts.batch import ForwardBatch, ForwardMode
from backplane.contracts.forward_context import ForwardContext
from backplane.executor.graph_sizes import (GraphKey, capture_batch_sizes, combine_variants, padded_size,
                                            tokens_per_request)
from backplane.contracts.model import ModelOutput
from backplane.models.base import ModelContext
from backplane.executor.compiled import CompiledForward

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
    """Free device memory once the allocator's unused cache is returned (graph pools stay held)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
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


@dataclass
class StaticInputs:
    """The buffers captured graphs read; replay copies each real batch into them."""

    input_ids: torch.Tensor  # [max_tokens]
    positions: torch.Tensor  # [max_tokens]
    out_cache_loc: torch.Tensor  # [max_tokens]
    req_pool_indices: torch.Tensor  # [max_bs]
    seq_lens: torch.Tensor  # [max_bs]
    # TARGET_VERIFY only: the tree mask (see ForwardBatch) and the extend lengths.
    extend_prefix_lens: torch.Tensor  # [max_bs] int32
    extend_seq_lens: torch.Tensor  # [max_bs] int32
    mask_indptr: torch.Tensor  # [max_bs + 1] int64
    custom_mask: torch.Tensor  # [mask_size] bool, mask_size = max_bs * tokens_per_request * max_context_len

    @classmethod
    def allocate(cls, max_bs: int, max_tokens: int, device, mask_size: int = 0) -> StaticInputs:
        def zeros(n, dtype=torch.int64):
            return torch.zeros(n, dtype=dtype, device=device)

        return cls(zeros(max_tokens), zeros(max_tokens), zeros(max_tokens), zeros(max_bs), zeros(max_bs, torch.int32),
                   zeros(max_bs, torch.int32), zeros(max_bs, torch.int32), zeros(max_bs + 1),
                   zeros(mask_size, torch.bool))


def pad_into(static: StaticInputs, batch: ForwardBatch, key: GraphKey, pad_row: int, fill: int) -> ForwardBatch:
    """Copy `batch` into the static buffers padded to `key`, and return the padded batch view.

    Padded requests use request row `pad_row` (all zeros: slot 0), seq_len `fill`, and write their
    K/V to the dump slot 0.
    """
    bs, n = batch.batch_size, batch.num_tokens
    pbs, pn = key.batch_size, key.num_tokens
    static.input_ids[:n].copy_(batch.input_ids)
    static.positions[:n].copy_(batch.positions)
    static.out_cache_loc[:n].copy_(batch.out_cache_loc)
    static.req_pool_indices[:bs].copy_(batch.req_pool_indices)
    static.seq_lens[:bs].copy_(batch.seq_lens)
    if pbs > bs:
        static.input_ids[n:pn].zero_()
        static.positions[n:pn].zero_()
        static.out_cache_loc[n:pn].zero_()
        static.req_pool_indices[bs:pbs].fill_(pad_row)
        static.seq_lens[bs:pbs].fill_(fill)
    pad = torch.full((pbs - bs,), fill, dtype=torch.int32)
    seq_lens_cpu = torch.cat([batch.seq_lens_cpu.to(torch.int32), pad])
    view = _view(static, key, batch, seq_lens_cpu)
    if key.mode is ForwardMode.TARGET_VERIFY:
        _pad_verify(static, view, key, batch.custom_mask, bs)
    return view


def _pad_verify(static: StaticInputs, view: ForwardBatch, key: GraphKey, real_mask: torch.Tensor | None,
                real_bs: int) -> None:
    """Fill the verify fields of a padded view: the real requests' tree mask, then an all-visible
    [tokens_per_request, seq_len] block for each padded request; extend lengths from seq_lens."""
    if real_mask is None:
        raise ValueError("graph runner: a TARGET_VERIFY batch needs custom_mask, got None")
    pbs, tpr = view.batch_size, key.tokens_per_request
    sizes = tpr * view.seq_lens_cpu.to(torch.int64)  # [pbs] mask entries per request
    indptr = torch.zeros(pbs + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(sizes, 0)
    real, total = int(indptr[real_bs]), int(indptr[pbs])
    if total > static.custom_mask.numel():
        raise ValueError(f"graph runner: expected a verify mask of at most {static.custom_mask.numel()} entries, "
                         f"got {total}")
    static.custom_mask[:real].copy_(real_mask.view(-1)[:real])
    static.custom_mask[real:total].fill_(True)
    static.mask_indptr[: pbs + 1].copy_(indptr, non_blocking=True)  # a fresh host tensor: no stream sync
    static.extend_seq_lens[:pbs].fill_(tpr)
    torch.sub(static.seq_lens[:pbs], tpr, out=static.extend_prefix_lens[:pbs])
    view.custom_mask, view.mask_indptr = static.custom_mask[:total], static.mask_indptr[: pbs + 1]
    view.extend_seq_lens, view.extend_prefix_lens = static.extend_seq_lens[:pbs], static.extend_prefix_lens[:pbs]
    view.extend_seq_lens_cpu = torch.full((pbs,), tpr, dtype=torch.int32)
    view.extend_prefix_lens_cpu = view.seq_lens_cpu.to(torch.int32) - tpr


def _view(static: StaticInputs, key: GraphKey, like: ForwardBatch, seq_lens_cpu: torch.Tensor) -> ForwardBatch:
    pbs, pn = key.batch_size, key.num_tokens
    return ForwardBatch(
        forward_mode=key.mode, batch_size=pbs, input_ids=static.input_ids[:pn],
        positions=static.positions[:pn], req_pool_indices=static.req_pool_indices[:pbs],
        seq_lens=static.seq_lens[:pbs], seq_lens_cpu=seq_lens_cpu, out_cache_loc=static.out_cache_loc[:pn],
        req_to_token_pool=like.req_to_token_pool, token_to_kv_pool=like.token_to_kv_pool,
        spec_info=like.spec_info, plugin_inputs=dict(like.plugin_inputs),
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
    """Captures and replays decode graphs for one model runner.

    extras_variants: the graph-key extras to capture each size for; by default every combination
    of the contributors' `graph_variants()`.
    """

    def __init__(self, ctx: GraphRunnerContext, modes: list[ForwardMode], extras_variants: list[tuple] | None = None):
        self.ctx = ctx
        self.model = ctx.model
        self.backend = ctx.attn_backend
        self.fill = ctx.attention.spec.seq_len_fill_value
        self.pad_row = ctx.req_to_token_pool.size - 1
        self.sizes, self.compile_sizes = capture_batch_sizes(ctx.config, self.pad_row)
        self.modes = modes
        self.tokens_per_request = {m: tokens_per_request(ctx.config, m) for m in modes}
        self.extras_variants = extras_variants or combine_variants([c.graph_variants() for c in ctx.contributors])
        max_bs = max(self.sizes)
        max_tokens = max_bs * max(self.tokens_per_request.values())
        verify_tpr = self.tokens_per_request.get(ForwardMode.TARGET_VERIFY, 0)
        mask_size = max_bs * verify_tpr * ctx.req_to_token_pool.max_context_len
        self.static = StaticInputs.allocate(max_bs, max_tokens, ctx.device, mask_size)
        self.backend.init_graph_state(max_bs, max_tokens)
        # Every graph writes its fp32 logits into views of this one buffer (only one graph replays at
        # a time): kept outputs of their own would hold a [tokens, vocab] tensor per graph in the pool,
        # and the draft runners capturing later could reuse none of it.
        self.static_logits = torch.empty((max_tokens, self.model.vocab_size), dtype=torch.float32,
                                         device=ctx.device)
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.compiled: CompiledForward | None = None
        self.outputs: dict[GraphKey, ModelOutput] = {}
        self.capture_seconds = 0.0
        self.graph_memory_bytes = 0  # growth of the graph pool during capture
        self.device_memory_bytes = 0  # drop of the device's free memory during capture (all causes)

    def keys(self) -> list[GraphKey]:
        return [GraphKey(mode, bs, self.tokens_per_request[mode], extras)
                for mode in self.modes for extras in self.extras_variants for bs in reversed(self.sizes)]

    # -- capture --------------------------------------------------------------------------------

    def capture(self) -> None:
        from tqdm import tqdm

        keys = self.keys()
        free_before = _free_after_releasing_cache()
        pool_before = pool_bytes(global_graph_pool())
        start = time.perf_counter()
        for key in tqdm(keys, desc="capturing CUDA graphs", leave=False, disable=not sys.stderr.isatty()):
            try:
                self._capture_one(key)
            except Exception as exc:
                raise GraphCaptureError(self._failure_message(key, exc)) from exc
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        self.device_memory_bytes = free_before - _free_after_releasing_cache()
        self.graph_memory_bytes = pool_bytes(global_graph_pool()) - pool_before
        logger.info("captured %d CUDA graphs (batch sizes %s) in %.1f s: graph pool +%.0f MB (device %.0f MB)",
                    len(keys), self.sizes, self.capture_seconds, self.graph_memory_bytes / 2**20,
                    self.device_memory_bytes / 2**20)

    def fill_for(self, key: GraphKey) -> int:
        """seq_len of padded requests: the backend's value, but at least the new tokens of a verify."""
        if key.mode is ForwardMode.TARGET_VERIFY:
            return max(self.fill, key.tokens_per_request)
        return self.fill

    def _capture_batch(self, key: GraphKey) -> ForwardBatch:
        fill = self.fill_for(key)
        self.static.req_pool_indices[: key.batch_size].fill_(self.pad_row)
        self.static.seq_lens[: key.batch_size].fill_(fill)
        self.static.out_cache_loc[: key.num_tokens].zero_()
        seq_lens_cpu = torch.full((key.batch_size,), fill, dtype=torch.int32)
        like = ForwardBatch(forward_mode=key.mode, batch_size=key.batch_size, input_ids=self.static.input_ids,
                            positions=self.static.positions, req_pool_indices=self.static.req_pool_indices,
                            seq_lens=self.static.seq_lens, seq_lens_cpu=seq_lens_cpu,
                            out_cache_loc=self.static.out_cache_loc, req_to_token_pool=self.ctx.req_to_token_pool,
                            token_to_kv_pool=self.ctx.token_to_kv_pool)
        view = _view(self.static, key, like, seq_lens_cpu)
        if key.mode is ForwardMode.TARGET_VERIFY:  # capture with a mask: replays always carry one
            _pad_verify(self.static, view, key, self.static.custom_mask[:0], 0)
        return view

    def _capture_one(self, key: GraphKey) -> None:
        batch = self._capture_batch(key)
        self.backend.init_metadata_for_capture(key, batch)
        forward, ops = self._forward_fn(key)
        # NOTE: bound once for the warm-up runs and the capture (they run the same batch); a replay
        # runs no Python, so nothing is bound then. Verify graphs return the hidden states (EAGLE
        # drafts from them; harmless for other algorithms).
        context = ForwardContext(batch=batch, attn_backend=self.backend, ops=ops,
                                 bindings=self.prepare_contributors(batch, key),
                                 capture_hidden=key.mode is ForwardMode.TARGET_VERIFY,
                                 logits_out=self.static_logits, graph_key=key)
        with self.ctx.model_ctx.bind(context):
            self.graphs[key], self.outputs[key] = capture_graph(lambda: forward(batch), global_graph_pool())

    def _forward_fn(self, key: GraphKey):
        """(what a graph of `key` records, with which op table): the model, or its torch.compile."""
        ops = self.ctx.model_ctx.default_ops
        if key.batch_size not in self.compile_sizes:
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
        return (f"CUDA graph capture failed at batch size {key.batch_size} ({key.mode.value}, attention "
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

    def can_run(self, batch: ForwardBatch) -> bool:
        return self.key_for(batch) is not None

    def replay(self, batch: ForwardBatch, key: GraphKey | None = None) -> ModelOutput:
        """Replay the graph of `key` (default: `key_for(batch)`) for `batch`; its output sliced back."""
        key = key or self.key_for(batch)
        padded = pad_into(self.static, batch, key, self.pad_row, self.fill_for(key))
        self.prepare_contributors(padded, key, real=batch)
        self.backend.init_metadata_for_replay(key, padded)
        self.graphs[key].replay()
        out = self.outputs[key]
        n = batch.num_tokens
        hidden = out.hidden_states[:n] if out.hidden_states is not None else None
        return ModelOutput(logits=out.logits[:n], hidden_states=hidden)
