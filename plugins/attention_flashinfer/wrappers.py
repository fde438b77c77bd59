"""FlashInfer wrapper objects: creating them (eager or bound to graph buffers), planning, running.

One wrapper holds one plan, so there is one per (role, layer config): the roles are the decode
wrapper, the ragged prefill wrapper, and three paged prefill wrappers ("prefix" non-causal over the
cached prefix, "paged" causal over all keys, "masked" with a custom mask; kept apart because a
paged wrapper resolves its kernel family at its first plan, and FA3 has no custom mask).

Paged and decode wrappers are pinned to FlashInfer's "fa2" kernels (custom masks, empty prefixes
and CUDA-graph re-planning all work there, and "auto" could pick cuDNN for decode on SM100); the
ragged wrapper keeps "auto" (FA3 on Hopper), which is where prefill time goes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from backplane.plugins.attention_flashinfer.geometry import (
    DECODE,
    MASKED,
    PAGED,
    RAGGED,
    RAGGED_PREFIX,
    ForwardGeometry,
    GraphBuffers,
    LayerConfig,
)

KV_LAYOUT = "NHD"  # the pool is [slots, heads, dim]; one slot = one page of one token
PAGED_BACKEND = "fa2"
MAX_THREADS_PER_BLOCK = 1024
PREFIX = "prefix"
ROUTE_ROLES = {DECODE: (DECODE,), RAGGED: (RAGGED,), RAGGED_PREFIX: (RAGGED, PREFIX), PAGED: (PAGED,), MASKED: (MASKED,)}


@dataclass(frozen=True)
class Dims:
    """Head layout and dtypes every plan of the backend shares."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype


@dataclass(frozen=True, eq=False)
class GraphBinding:
    """The slices of GraphBuffers that the wrappers of one captured batch size own."""

    buffers: GraphBuffers
    batch_size: int
    masked: bool

    def decode_kwargs(self) -> dict[str, Any]:
        bs, b = self.batch_size, self.buffers
        return dict(
            use_cuda_graph=True,
            paged_kv_indptr_buffer=b.kv_indptr[: bs + 1],
            paged_kv_indices_buffer=b.kv_indices,
            paged_kv_last_page_len_buffer=b.last_page_len[:bs],
        )

    def prefill_kwargs(self, masked: bool) -> dict[str, Any]:
        bs, b = self.batch_size, self.buffers
        return dict(
            use_cuda_graph=True,
            qo_indptr_buf=b.qo_indptr[: bs + 1],
            paged_kv_indptr_buf=b.kv_indptr[: bs + 1],
            paged_kv_indices_buf=b.kv_indices,
            paged_kv_last_page_len_buf=b.last_page_len[:bs],
            custom_mask_buf=b.custom_mask if masked else None,
            mask_indptr_buf=b.mask_indptr[: bs + 1] if masked else None,
        )


class WrapperCache:
    """The wrappers of the eager path (binding None) or of one captured graph, by (role, config)."""

    def __init__(self, workspace: torch.Tensor, use_tensor_cores: bool, binding: GraphBinding | None = None):
        self.workspace = workspace
        self.use_tensor_cores = use_tensor_cores
        self.binding = binding
        self._wrappers: dict[tuple[str, LayerConfig], Any] = {}

    def get(self, role: str, config: LayerConfig) -> Any:
        key = (role, config)
        if key not in self._wrappers:
            self._wrappers[key] = self._create(role)
        return self._wrappers[key]

    def _create(self, role: str) -> Any:
        import flashinfer

        graph = self.binding
        if role == DECODE:
            kwargs = graph.decode_kwargs() if graph else {}
            return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, KV_LAYOUT, use_tensor_cores=self.use_tensor_cores, backend=PAGED_BACKEND, **kwargs
            )
        if role == RAGGED:
            assert graph is None, "ragged prefill is never captured"
            return flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, KV_LAYOUT)
        kwargs = graph.prefill_kwargs(masked=role == MASKED) if graph else {}
        return flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, KV_LAYOUT, backend=PAGED_BACKEND, **kwargs)


def plan(wrapper: Any, role: str, geo: ForwardGeometry, config: LayerConfig, dims: Dims) -> None:
    """Plan `wrapper` (of `role`) for the batch in `geo` and the layers sharing `config` (host side)."""
    common = dict(
        window_left=config.window_left,
        logits_soft_cap=config.logits_soft_cap,
        sm_scale=config.sm_scale,
        q_data_type=dims.q_dtype,
        kv_data_type=dims.kv_dtype,
    )
    heads = (dims.num_heads, dims.num_kv_heads, dims.head_dim)
    if role == DECODE:
        span = geo.full
        wrapper.plan(span.indptr_cpu, span.indices, span.last_page_len_cpu, *heads, 1, **common)
    elif role == RAGGED:
        wrapper.plan(geo.qo_indptr_cpu, geo.qo_indptr_cpu, *heads, causal=True, **common)
    else:
        span = geo.prefix if role == PREFIX else geo.full
        wrapper.plan(
            geo.qo_indptr_cpu,
            span.indptr_cpu,
            span.indices,
            span.last_page_len_cpu,
            *heads,
            1,  # page_size
            causal=role == PAGED,
            custom_mask=geo.custom_mask if role == MASKED else None,
            uniform_q_len=geo.uniform_q_len,
            **common,
        )


@dataclass
class LayerRunner:
    """Runs the planned wrappers of one route for every layer that shares a LayerConfig."""

    route: str
    wrappers: tuple[Any, ...]

    def __call__(self, q, k, v, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] (new tokens); kv_cache: ([pages, 1, Hkv, D],) * 2 -> [T, H, D]."""
        q = q.contiguous()
        if self.route == RAGGED:
            return self.wrappers[0].run(q, _like(k, kv_cache), _like(v, kv_cache))
        if self.route == RAGGED_PREFIX:
            ragged, prefix = self.wrappers
            o_new, lse_new = ragged.run(q, _like(k, kv_cache), _like(v, kv_cache), return_lse=True)
            o_old, lse_old = prefix.run(q, kv_cache, return_lse=True)
            return merge_attention(o_new, lse_new, o_old, lse_old)
        return self.wrappers[0].run(q, kv_cache)


def merge_attention(o_a, lse_a, o_b, lse_b) -> torch.Tensor:
    """Attention over key sets A and B from the parts: o_*: [T, H, D]; lse_*: [T, H] fp32, base 2.

    FlashInfer's merge kernel puts all heads of a token in one thread block of
    (head_dim / vec_size) x num_heads threads, so many heads fall back to plain torch.
    """
    num_tokens, num_heads, head_dim = o_a.shape
    vec_size = max(16 // o_a.element_size(), head_dim // 32)
    if num_tokens > 0 and num_heads * (head_dim // vec_size) <= MAX_THREADS_PER_BLOCK:
        import flashinfer

        return flashinfer.merge_state(o_a, lse_a, o_b, lse_b)[0]
    lse = torch.logaddexp2(lse_a, lse_b)
    weight_a, weight_b = torch.exp2(lse_a - lse)[..., None], torch.exp2(lse_b - lse)[..., None]
    return (o_a.float() * weight_a + o_b.float() * weight_b).to(o_a.dtype)


def _like(x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """New keys/values in the pool's dtype, contiguous (as the ragged kernel was planned)."""
    return x.to(kv_cache[0].dtype).contiguous()


def plan_layer(cache: WrapperCache, geo: ForwardGeometry, config: LayerConfig, dims: Dims) -> LayerRunner:
    """Plan every wrapper the route of `config` needs and return the runner for those layers."""
    route = geo.route(config)
    wrappers = []
    for role in ROUTE_ROLES[route]:
        wrapper = cache.get(role, config)
        plan(wrapper, role, geo, config, dims)
        wrappers.append(wrapper)
    return LayerRunner(route, tuple(wrappers))
