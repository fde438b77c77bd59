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

import functools
import logging
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

logger = logging.getLogger(__name__)

KV_LAYOUT = "NHD"  # the pool is [slots, heads, dim]; one slot = one page of one token
PAGED_BACKEND = "fa2"
MAX_THREADS_PER_BLOCK = 1024
PREFIX = "prefix"
ROUTE_ROLES = {DECODE: (DECODE,), RAGGED: (RAGGED,), RAGGED_PREFIX: (RAGGED, PREFIX), PAGED: (PAGED,), MASKED: (MASKED,)}


@dataclass(frozen=True)
class Dims:
    """Head layout and dtypes every plan of the backend shares (kv_dtype: the pool's, float8_e4m3fn
    for an FP8 KV cache)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype

    @property
    def kv_fp8(self) -> bool:
        return self.kv_dtype == torch.float8_e4m3fn

    def kv_dtype_of(self, role: str) -> torch.dtype:
        """The K/V dtype the wrapper of `role` reads: the pool's for the paged ones; the ragged one
        takes the new tokens, which over an FP8 pool come dequantized in q's dtype (`LayerRunner`)."""
        return self.q_dtype if role == RAGGED and self.kv_fp8 else self.kv_dtype


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

    def prefill_kwargs(self, masked: bool, window_left: int = -1) -> dict[str, Any]:
        """masked: the wrapper takes a custom mask, into the mask buffer of its `window_left`."""
        bs, b = self.batch_size, self.buffers
        return dict(
            use_cuda_graph=True,
            qo_indptr_buf=b.qo_indptr[: bs + 1],
            paged_kv_indptr_buf=b.kv_indptr[: bs + 1],
            paged_kv_indices_buf=b.kv_indices,
            paged_kv_last_page_len_buf=b.last_page_len[:bs],
            custom_mask_buf=b.mask_buffer(window_left) if masked else None,
            mask_indptr_buf=b.mask_indptr[: bs + 1] if masked else None,
        )


class WrapperCache:
    """The wrappers of the eager path (binding None) or of one captured graph, by (role, config).

    A captured graph's wrappers are re-planned at every replay. After the first full plan(), a
    decode wrapper and a causal paged one (an EXTEND graph's) take the short road (`replan_decode`,
    `replan_paged`) once it proved to give the same plan; `fast_replans` counts those replays.
    """

    def __init__(self, workspace: torch.Tensor, use_tensor_cores: bool, binding: GraphBinding | None = None):
        self.workspace = workspace
        self.use_tensor_cores = use_tensor_cores
        self.binding = binding
        self._wrappers: dict[tuple[str, LayerConfig], Any] = {}
        self.fast_plan: dict[tuple[str, LayerConfig], bool] = {}  # key -> its short road proved equal
        self.fast_replans = 0

    @property
    def fast_decode(self) -> dict[tuple[str, LayerConfig], bool]:
        """The name `fast_plan` had while only decode wrappers took a short road."""
        return self.fast_plan

    def get(self, role: str, config: LayerConfig) -> Any:
        key = (role, config)
        if key not in self._wrappers:
            self._wrappers[key] = self._create(role, config)
        return self._wrappers[key]

    def _create(self, role: str, config: LayerConfig) -> Any:
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
        kwargs = graph.prefill_kwargs(masked=role == MASKED, window_left=config.window_left) if graph else {}
        return flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, KV_LAYOUT, backend=PAGED_BACKEND, **kwargs)


def plan_cached(cache: WrapperCache, role: str, geo: ForwardGeometry, config: LayerConfig, dims: Dims) -> Any:
    """The wrapper of (role, config) in `cache`, planned for `geo`: a graph's decode and causal paged
    wrappers by their short road once it proved equal to plan(), everything else by plan()."""
    wrapper = cache.get(role, config)
    key = (role, config)
    short = _short_road(cache, role, geo)
    if short is None:
        plan(wrapper, role, geo, config, dims)
    elif cache.fast_plan.get(key):
        short(wrapper, geo, config, dims)
        cache.fast_replans += 1
    else:
        plan(wrapper, role, geo, config, dims)
        if key not in cache.fast_plan:
            cache.fast_plan[key] = _replan_matches(wrapper, role, short, geo, config, dims)
    return wrapper


def _short_road(cache: WrapperCache, role: str, geo: ForwardGeometry) -> Any:
    """The short re-plan of a graph-bound wrapper of `role` for `geo`, or None where only plan() will do:
    eager wrappers, the masked one (plan() packs the mask) and a paged one promised a uniform query
    length (plan() forwards the promise to the planner)."""
    if cache.binding is None:
        return None
    if role == DECODE:
        return replan_decode
    if role == PAGED and geo.uniform_q_len is None:
        return replan_paged
    return None


def replan_decode(wrapper: Any, geo: ForwardGeometry, config: LayerConfig, dims: Dims) -> None:
    """Re-plan a graph-bound decode wrapper that plan() has planned once, for a batch of its size.

    plan() spends most of a small decode step's host time on checks, dtype resolution, copying the
    index arrays into the graph's buffers (make_span has already written them there) and API logging;
    what changes from one replay to the next is only the work split, which FlashInfer's compiled
    planner computes from the host lengths. This calls that planner directly, as plan() does for a
    CUDA-graph wrapper on the "fa2" backend (tensor cores) or the decode kernels (CUDA cores), and
    keeps everything else plan() set. It reads FlashInfer's private attributes, so WrapperCache uses it
    only after `_replan_matches` showed it yields plan()'s own plan on this FlashInfer.
    """
    span = geo.full
    batch_size = span.kv_lens_cpu.numel()
    workspaces = (wrapper._float_workspace_buffer, wrapper._int_workspace_buffer,
                  wrapper._pin_memory_int_workspace_buffer)
    heads = (dims.num_heads, dims.num_kv_heads)
    if wrapper.use_tensor_cores:
        wrapper._max_kv_len = int(span.kv_lens_cpu.max())
        args = (*workspaces, _arange_cpu(batch_size + 1), span.indptr_cpu, span.kv_lens_cpu, batch_size, batch_size,
                *heads, 1, True, dims.head_dim, dims.head_dim, False, config.window_left,
                -1, False, 0, 0)  # fixed_split_size, disable_split_kv, num_colocated_ctas, uniform_q_len
    else:
        args = (*workspaces, span.indptr_cpu, batch_size, *heads, 1, True, config.window_left, config.logits_soft_cap,
                dims.head_dim, dims.head_dim, _empty_cpu(dims.q_dtype), _empty_cpu(dims.kv_dtype))
    wrapper._plan_info = wrapper._cached_module.plan(*args)
    wrapper._batch_size = batch_size


def replan_paged(wrapper: Any, geo: ForwardGeometry, config: LayerConfig, dims: Dims) -> None:
    """Re-plan a graph-bound causal paged prefill wrapper (an EXTEND graph's) that plan() has planned
    once, for a batch of its size.

    Of what plan() does at a replay, the graph needs only two things: the query indptr in the
    wrapper's buffer, and the work split, which FlashInfer's compiled planner computes from the host
    lengths into the int workspace. The key indptr and indices are already in the graph's buffers
    (`make_span` wrote them where the wrapper reads), and the last-page lengths are ones. plan()
    copies all of them again (four more copies), plus the key lengths, which the "fa2" kernels do not
    read, and resolves dtypes, checks and logs in Python. Like `replan_decode`, this reads
    FlashInfer's private attributes, so WrapperCache uses it only after `_replan_matches` showed it
    yields plan()'s own plan on this FlashInfer.
    """
    span, qo_indptr = geo.full, geo.qo_indptr_cpu
    batch_size, total_rows = qo_indptr.numel() - 1, int(qo_indptr[-1])
    wrapper._qo_indptr_buf.copy_(qo_indptr, non_blocking=True)
    args = (wrapper._float_workspace_buffer, wrapper._int_workspace_buffer, wrapper._pin_memory_int_workspace_buffer,
            qo_indptr, span.indptr_cpu, span.kv_lens_cpu, wrapper._max_total_num_rows or total_rows, batch_size,
            dims.num_heads, dims.num_kv_heads, 1, True, dims.head_dim, dims.head_dim, True, config.window_left,
            -1, False, 0, 0)  # fixed_split_size, disable_split_kv, num_colocated_ctas, uniform_q_len
    wrapper._plan_info = wrapper._cached_module.plan(*args)
    wrapper._qo_indptr_last = total_rows


def _replan_matches(wrapper: Any, role: str, short: Any, geo: ForwardGeometry, config: LayerConfig,
                    dims: Dims) -> bool:
    """Whether the short road `short`, right after plan() for the same batch, yields the same plan
    (and runs); if not, plan() again."""
    if getattr(wrapper, "_backend", None) != PAGED_BACKEND:
        return False
    try:
        expected = list(wrapper._plan_info)
        short(wrapper, geo, config, dims)
        same = list(wrapper._plan_info) == expected
    except Exception as e:  # noqa: BLE001 - another FlashInfer's planner signature: keep plan()
        logger.warning("flashinfer attention: the short %s re-plan does not fit this FlashInfer (%s); "
                       "re-planning with plan()", role, e)
        same = False
    if not same:
        plan(wrapper, role, geo, config, dims)
    return same


@functools.cache
def _arange_cpu(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int32)


@functools.cache
def _empty_cpu(dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(0, dtype=dtype)


def plan(wrapper: Any, role: str, geo: ForwardGeometry, config: LayerConfig, dims: Dims) -> None:
    """Plan `wrapper` (of `role`) for the batch in `geo` and the layers sharing `config` (host side).
    A masked wrapper gets the window folded into its mask by position (`geo.mask_for`), none of its own."""
    common = dict(
        window_left=-1 if role == MASKED else config.window_left,
        logits_soft_cap=config.logits_soft_cap,
        sm_scale=config.sm_scale,
        q_data_type=dims.q_dtype,
        kv_data_type=dims.kv_dtype_of(role),
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
            custom_mask=geo.mask_for(config) if role == MASKED else None,
            uniform_q_len=geo.uniform_q_len,
            **common,
        )


@dataclass
class LayerRunner:
    """Runs the planned wrappers of one route for every layer that shares a LayerConfig."""

    route: str
    wrappers: tuple[Any, ...]

    def __call__(self, q, k, v, kv_cache: tuple[torch.Tensor, torch.Tensor], kv: KVView | None = None) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] (new tokens); kv_cache: ([pages, 1, Hkv, D],) * 2 -> [T, H, D].

        kv: the layer's FP8 scales and round trip (None: a pool of the model's dtype). The paged
        wrappers read the float8 cache and get k_scale / v_scale at run(); the ragged one gets the
        new tokens as the cache gives them back (dequantized in q's dtype)."""
        q = q.contiguous()
        scales = {} if kv is None else dict(k_scale=kv.k_scale, v_scale=kv.v_scale)
        if self.route in (RAGGED, RAGGED_PREFIX):
            k, v = kv.round_trip(k, v) if kv is not None else (_like(k, kv_cache), _like(v, kv_cache))
            k, v = k.contiguous(), v.contiguous()
        if self.route == RAGGED:
            return self.wrappers[0].run(q, k, v)
        if self.route == RAGGED_PREFIX:
            ragged, prefix = self.wrappers
            o_new, lse_new = ragged.run(q, k, v, return_lse=True)
            o_old, lse_old = prefix.run(q, kv_cache, return_lse=True, **scales)
            return merge_attention(o_new, lse_new, o_old, lse_old)
        return self.wrappers[0].run(q, kv_cache, **scales)


@dataclass(frozen=True)
class KVView:
    """One layer of an FP8 pool as a runner reads it: its scales (stored * scale = value) and
    `round_trip(k, v)`, the new tokens as the pool gives them back (TokenToKVPool.round_trip)."""

    k_scale: float
    v_scale: float
    round_trip: Any


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
        wrappers.append(plan_cached(cache, role, geo, config, dims))
    return LayerRunner(route, tuple(wrappers))
