"""The torch_native attention backend: plain PyTorch, one request at a time, fp32 arithmetic.

It is the reference the other backends are tested against: correct, not fast. It reads every
key of a request through `req_to_token`, so it serves every forward mode on any device, but it
plans on the host from `seq_lens_cpu`, so it never runs inside a CUDA graph. Over an FP8 pool it
attends to the dequantized keys and values (stored * the layer's scale, `dequantize_kv`), the new
tokens' included: the FP8 reference.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from backplane.contracts.attention import (
    AttentionBackend,
    AttentionBackendContext,
    AttentionLayerInfo,
)
from backplane.contracts.batch import ForwardBatch, ForwardMode
from backplane.contracts.memory import dequantize_kv
from backplane.plugin.registry import ALL_MODES, AttentionBackendSpec


@dataclass(frozen=True)
class _RequestPlan:
    """Where one request's queries sit in the batch and which keys it sees (host ints)."""

    row: int  # the request's row in req_to_token
    q_start: int  # first query token in the flattened batch
    num_queries: int
    seq_len: int  # keys 0..seq_len-1 (prefix and new tokens)
    mask_start: int | None  # offset of its [num_queries, seq_len] block in custom_mask, if any


def _plan(batch: ForwardBatch) -> list[_RequestPlan]:
    bs = batch.batch_size
    seq_lens = batch.seq_lens_cpu.tolist()
    rows = batch.req_pool_indices.tolist()
    if batch.forward_mode.is_decode:
        num_queries = [1] * bs
    elif batch.extend_seq_lens_cpu is not None:
        num_queries = batch.extend_seq_lens_cpu.tolist()
    else:
        num_queries = [batch.tokens_per_request] * bs
    mask_starts = _mask_starts(batch)
    starts = [0, *itertools.accumulate(num_queries)]
    return [
        _RequestPlan(int(rows[i]), starts[i], int(num_queries[i]), int(seq_lens[i]), mask_starts[i])
        for i in range(bs)
    ]


def _mask_starts(batch: ForwardBatch) -> list[int | None]:
    mode = batch.forward_mode
    if mode is ForwardMode.TARGET_VERIFY and batch.custom_mask is None:
        raise ValueError("torch_native attention: TARGET_VERIFY needs batch.custom_mask, got None")
    if mode.is_decode or batch.custom_mask is None:
        return [None] * batch.batch_size
    if batch.mask_indptr is None:
        raise ValueError("torch_native attention: custom_mask is set but mask_indptr is None")
    return [int(x) for x in batch.mask_indptr.tolist()[: batch.batch_size]]


def _visible(plan: _RequestPlan, layer: AttentionLayerInfo, batch: ForwardBatch, device) -> torch.Tensor:
    """Which keys each query may see: [num_queries, seq_len] bool.

    Causality and the custom mask go by key index (the column of the request's row in
    req_to_token); the sliding window goes by position (`_key_positions`).
    """
    prefix = plan.seq_len - plan.num_queries
    index = torch.arange(plan.seq_len, device=device)
    if plan.mask_start is not None:
        end = plan.mask_start + plan.num_queries * plan.seq_len
        mask = batch.custom_mask[plan.mask_start : end].view(plan.num_queries, plan.seq_len).bool()
    else:
        mask = index[None, :] <= index[prefix:, None]  # causal
    if layer.sliding_window > 0:
        k_pos = _key_positions(plan, batch, device)  # [seq_len]
        q_pos = k_pos[prefix:]  # a query is the request's new key of its own index
        mask = mask & (k_pos[None, :] > q_pos[:, None] - layer.sliding_window)
    return mask


def _key_positions(plan: _RequestPlan, batch: ForwardBatch, device) -> torch.Tensor:
    """The position of each key of a request: [seq_len] int64.

    The cached prefix holds positions 0..prefix-1 at their own indices. Without a custom mask the
    new tokens follow in order (EXTEND, DRAFT_EXTEND, DECODE: a key's index is its position). Under
    a custom mask they are the nodes of a draft tree (TARGET_VERIFY), node i at num_cached +
    depth(i), not num_cached + i: their positions are the batch's.
    """
    if plan.mask_start is None:
        return torch.arange(plan.seq_len, device=device)
    prefix = plan.seq_len - plan.num_queries
    new = batch.positions[plan.q_start : plan.q_start + plan.num_queries].to(device, torch.int64)
    return torch.cat([torch.arange(prefix, device=device), new])


def _attend(q, keys, values, visible, layer: AttentionLayerInfo) -> torch.Tensor:
    """q: [n, H, D]; keys, values: [S, Hk, D]; visible: [n, S] -> o: [n, H, D] in fp32."""
    group = layer.num_heads // layer.num_kv_heads
    keys = keys.float().repeat_interleave(group, dim=1)  # [S, H, D]
    values = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,shd->hns", q.float(), keys) * layer.scaling  # [H, n, S]
    if layer.logit_softcap > 0:
        scores = layer.logit_softcap * torch.tanh(scores / layer.logit_softcap)
    scores = scores.masked_fill(~visible[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hns,shd->nhd", probs, values)


class TorchNativeAttnBackend(AttentionBackend):
    """Reference attention in plain PyTorch; see the module docstring."""

    def __init__(self, ctx: AttentionBackendContext):
        self.ctx = ctx
        self._plans: list[_RequestPlan] = []
        self._planned_for: ForwardBatch | None = None

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._plans = _plan(batch)
        self._planned_for = batch

    def _plans_for(self, batch: ForwardBatch) -> list[_RequestPlan]:
        if self._planned_for is not batch:
            self.init_forward_metadata(batch)
        return self._plans

    def _run(self, q, k, v, layer: AttentionLayerInfo, batch: ForwardBatch) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        pool = batch.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, batch.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        k_scale, v_scale = pool.kv_scales(layer.layer_id)
        req_to_token = batch.req_to_token_pool.req_to_token
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for plan in self._plans_for(batch):
            slots = req_to_token[plan.row, : plan.seq_len].long()  # [seq_len]
            queries = slice(plan.q_start, plan.q_start + plan.num_queries)
            visible = _visible(plan, layer, batch, q.device)
            keys, values = dequantize_kv(k_buf[slots], k_scale), dequantize_kv(v_buf[slots], v_scale)
            out[queries] = _attend(q[queries], keys, values, visible, layer).to(q.dtype)
        return out

    def forward_extend(self, q, k, v, layer: AttentionLayerInfo, batch: ForwardBatch) -> torch.Tensor:
        return self._run(q, k, v, layer, batch)

    def forward_decode(self, q, k, v, layer: AttentionLayerInfo, batch: ForwardBatch) -> torch.Tensor:
        return self._run(q, k, v, layer, batch)


SPEC = AttentionBackendSpec(
    name="torch_native",
    factory=TorchNativeAttnBackend,
    description="plain PyTorch reference attention (any device, slow)",
    platforms=("cpu", "cuda"),
    modes=ALL_MODES,
    custom_mask=True,
    sliding_window=True,
    logit_softcap=True,
    priority=0,
    kv_cache_dtypes=("fp8_e4m3",),
    graph_modes=(),
    # Host-planned per batch: extend captured piecewise (graph segments between its eager calls).
    # NOTE: decode and verify join once piecewise capture has run on a GPU (it was built without one).
    piecewise_graph_modes=("extend",),
)
