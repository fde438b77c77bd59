"""The "flashinfer" attention backend: plan once per forward pass, run per layer.

The KV pool is used in place as a paged cache with page size 1: each layer's
[num_slots + 1, num_kv_heads, head_dim] buffer is viewed as [pages, 1, num_kv_heads, head_dim] (NHD).
FlashInfer fixes the window, soft-cap and softmax scale at plan time, so the backend keeps one plan
per distinct LayerConfig. The configurations are learned from the layers themselves: the first
forward pass plans each one when its first layer runs, later passes (and graph captures and
replays) plan all known ones up front in init_forward_metadata / init_metadata_for_*.

FP8 KV cache: the paged wrappers are planned with kv_data_type float8_e4m3fn and run with the
layer's k_scale / v_scale (constants per layer, so graph replays use the captured ones); the
ragged wrapper (the new tokens of a prefill) takes them as the pool gives them back, in q's dtype.
The fused rotary + KV write is declined over an FP8 pool (`rotary_kv_write` takes no scales).
"""

from __future__ import annotations

from typing import Any

import torch

from backplane.attention import AttentionBackend, AttentionBackendContext, AttentionLayerInfo
from backplane import ForwardBatch, ForwardMode
from backplane.plugins.attention_flashinfer.geometry import ForwardGeometry, GraphBuffers, LayerConfig
from backplane.plugins.attention_flashinfer.options import FlashInferOptions
from backplane.plugins.attention_flashinfer.wrappers import (
    Dims,
    GraphBinding,
    KVView,
    LayerRunner,
    WrapperCache,
    plan_layer,
)

GRAPH_MODES = (ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND)


class _ForwardPlan:
    """The plans of one forward pass: its geometry and one LayerRunner per LayerConfig."""

    def __init__(self, geo: ForwardGeometry, cache: WrapperCache, dims: Dims):
        self.geo, self.cache, self.dims = geo, cache, dims
        self.runners: dict[LayerConfig, LayerRunner] = {}

    def runner(self, config: LayerConfig) -> LayerRunner:
        if config not in self.runners:
            self.runners[config] = plan_layer(self.cache, self.geo, config, self.dims)
        return self.runners[config]


class FlashInferAttnBackend(AttentionBackend):
    """FlashInfer attention over the page-size-1 KV pool; every mode, CUDA graphs for decode, verify,
    uniform draft extends and token-bucket extends (paged causal prefill, re-planned at every replay:
    FlashInfer's CUDA-graph prefill plans any query lengths that add up to the captured token count)."""

    def __init__(self, ctx: AttentionBackendContext):
        self.ctx = ctx
        options = ctx.options if ctx.options is not None else FlashInferOptions()
        self.use_tensor_cores = options.use_tensor_cores(ctx.num_heads, ctx.num_kv_heads, ctx.token_to_kv_pool.is_fp8)
        self.dims = Dims(ctx.num_heads, ctx.num_kv_heads, ctx.head_dim, ctx.dtype, ctx.token_to_kv_pool.dtype)
        # One float workspace shared by every wrapper; FlashInfer wants it zeroed before first use.
        self.workspace = torch.zeros(options.workspace_size_mb << 20, dtype=torch.uint8, device=ctx.device)
        self.layer_configs: dict[LayerConfig, None] = {}  # every config seen so far, in order
        self._eager = WrapperCache(self.workspace, self.use_tensor_cores)
        self._graph_buffers: GraphBuffers | None = None
        self._graph_caches: dict[Any, WrapperCache] = {}
        self._plan: _ForwardPlan | None = None

    # -- planning -----------------------------------------------------------------------------

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._start(ForwardGeometry(batch), self._eager)

    def init_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self._graph_buffers = GraphBuffers.allocate(max_bs, max_num_tokens, self.ctx.max_context_len, self.ctx.device)

    def init_metadata_for_capture(self, key: Any, batch: ForwardBatch) -> None:
        if self._graph_buffers is None:
            raise RuntimeError("flashinfer attention: init_graph_state must run before init_metadata_for_capture")
        if batch.forward_mode not in GRAPH_MODES:
            raise ValueError(
                f"flashinfer attention: CUDA graphs support modes {[m.value for m in GRAPH_MODES]}, "
                f"got {batch.forward_mode.value}"
            )
        if batch.forward_mode is ForwardMode.EXTEND and not getattr(key, "ragged", False):
            raise ValueError("flashinfer attention: an EXTEND graph needs a token-bucket key (GraphKey.token_bucket)")
        if batch.forward_mode is ForwardMode.DRAFT_EXTEND and batch.extend_seq_lens is not None:
            raise ValueError("flashinfer attention: a DRAFT_EXTEND graph needs the same number of tokens in every "
                             "request (no extend_seq_lens)")
        binding = GraphBinding(self._graph_buffers, batch.batch_size, masked=batch.custom_mask is not None)
        self._graph_caches[key] = WrapperCache(self.workspace, self.use_tensor_cores, binding)
        self._start(ForwardGeometry(batch, self._graph_buffers), self._graph_caches[key])

    def init_metadata_for_replay(self, key: Any, batch: ForwardBatch) -> None:
        cache = self._graph_caches.get(key)
        if cache is None:
            raise KeyError(f"flashinfer attention: no graph captured for key {key!r}")
        if batch.batch_size != cache.binding.batch_size or (batch.custom_mask is not None) != cache.binding.masked:
            raise ValueError(
                f"flashinfer attention: graph {key!r} was captured for batch size {cache.binding.batch_size} "
                f"{'with' if cache.binding.masked else 'without'} a custom mask; got batch size "
                f"{batch.batch_size} {'with' if batch.custom_mask is not None else 'without'} one"
            )
        self._start(ForwardGeometry(batch, self._graph_buffers), cache)

    def _start(self, geo: ForwardGeometry, cache: WrapperCache) -> None:
        self._plan = _ForwardPlan(geo, cache, self.dims)
        for config in self.layer_configs:
            self._plan.runner(config)

    def _runner(self, layer: AttentionLayerInfo) -> LayerRunner:
        if self._plan is None:
            raise RuntimeError("flashinfer attention: init_forward_metadata must run before the first layer")
        _check_layer(layer, self.dims)
        config = LayerConfig.of(layer)
        if config not in self._plan.runners:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"flashinfer attention: layer {layer.layer_id} has a configuration {config} first seen while "
                    "a CUDA graph is being captured; run one eager forward pass (warm-up) before capturing"
                )
            self.layer_configs[config] = None
        return self._plan.runner(config)

    # -- attention ----------------------------------------------------------------------------

    def fuses_rotary_kv_write(self, batch: ForwardBatch) -> bool:
        """Opted in: every route reads the keys from `batch.token_to_kv_pool` (the pool the layer's
        `rotary_kv_write` writes into), and the ragged one takes the new k, v as passed (rotated). One
        fused launch per layer instead of FlashInfer's rotary plus two indexed writes. Declined over
        an FP8 pool, which `set_kv_buffer` quantizes with the layer's scales."""
        return not batch.token_to_kv_pool.is_fp8

    def forward_extend(self, q, k, v, layer: AttentionLayerInfo, batch: ForwardBatch,
                       kv_written: bool = False) -> torch.Tensor:
        return self._forward(q, k, v, layer, batch, kv_written)

    def forward_decode(self, q, k, v, layer: AttentionLayerInfo, batch: ForwardBatch,
                       kv_written: bool = False) -> torch.Tensor:
        return self._forward(q, k, v, layer, batch, kv_written)

    def _forward(self, q, k, v, layer: AttentionLayerInfo, batch: ForwardBatch, kv_written: bool) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        runner = self._runner(layer)
        pool = batch.token_to_kv_pool
        if not kv_written:
            pool.set_kv_buffer(layer.layer_id, batch.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        kv_cache = (k_buf.unsqueeze(1), v_buf.unsqueeze(1))  # [pages, page_size=1, Hkv, D]
        if k_buf.dtype != self.dims.kv_dtype:
            raise ValueError(f"flashinfer attention: layer {layer.layer_id}: the batch's KV pool holds {k_buf.dtype}, "
                             f"expected {self.dims.kv_dtype} as the backend was built with")
        return runner(q, k, v, kv_cache, _kv_view(pool, layer.layer_id) if pool.is_fp8 else None)


def _kv_view(pool, layer_id: int) -> KVView:
    k_scale, v_scale = pool.kv_scales(layer_id)
    return KVView(k_scale, v_scale, lambda k, v: pool.round_trip(layer_id, k, v))


def _check_layer(layer: AttentionLayerInfo, dims: Dims) -> None:
    got = (layer.num_heads, layer.num_kv_heads, layer.head_dim)
    expected = (dims.num_heads, dims.num_kv_heads, dims.head_dim)
    if got != expected:
        raise ValueError(
            f"flashinfer attention: layer {layer.layer_id}: expected (num_heads, num_kv_heads, head_dim) "
            f"{expected} as the backend was built with, got {got}"
        )
