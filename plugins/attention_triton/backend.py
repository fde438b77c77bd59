"""TritonAttnBackend: the "triton" attention backend over the page-size-1 KV pool."""

from __future__ import annotations

from typing import Any

import torch

from backplane.attention import AttentionBackend, AttentionBackendContext, AttentionLayerInfo
from backplane import ForwardBatch, ForwardMode

from .configs import choose_num_kv_splits
from .decode_kernels import decode_attention
from .extend_kernels import extend_attention
from .graph import GraphBuffers
from .metadata import DecodeMetadata, ExtendMetadata, build_extend_metadata
from .options import TritonAttentionOptions
from .verify_kernels import verify_attention, verify_rows_fit


class TritonAttnBackend(AttentionBackend):
    """Split-KV decode, prefix-aware extend (causal or custom mask), graphs for decode and verify.
    Over an FP8 pool the kernels read float8 K/V and apply the layer's scales (fixed per layer, so
    graphs capture them as launch constants)."""

    def __init__(self, ctx: AttentionBackendContext):
        self.ctx = ctx
        self.options: TritonAttentionOptions = ctx.options or TritonAttentionOptions()
        self.device = torch.device(ctx.device)
        self.req_to_token = ctx.req_to_token_pool.req_to_token
        self.kv_pool = ctx.token_to_kv_pool
        self.forward_metadata: DecodeMetadata | ExtendMetadata | None = None
        self.graph_buffers: GraphBuffers | None = None
        # Decode with few KV splits merges inside its first kernel; these counters (one per request
        # row and KV head, every launch leaves them zero) order the slices of a group.
        self.merge_counters = torch.zeros(self.req_to_token.shape[0] * ctx.num_kv_heads, dtype=torch.int32,
                                          device=self.device)

    # -- planning -------------------------------------------------------------------------------

    def num_kv_splits(self, batch_size: int, max_kv_len: int) -> int:
        """The configured split count, or the heuristic one when the option is 0 (auto)."""
        if self.options.num_kv_splits > 0:
            return self.options.num_kv_splits
        return choose_num_kv_splits(
            batch_size, self.ctx.num_kv_heads, max_kv_len, self.device, self.options.max_kv_splits,
            kv_bytes=self.kv_pool.dtype.itemsize,
        )

    def uses_split_verify(self, tokens_per_request: int) -> bool:
        """Whether TARGET_VERIFY batches of this many tokens a request take the split-KV verify kernel."""
        return self.options.verify_kernel == "split" and verify_rows_fit(
            tokens_per_request, self.ctx.num_heads, self.ctx.num_kv_heads)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.forward_mode.is_decode:
            self.forward_metadata = self._decode_metadata(batch)
        elif batch.forward_mode.is_extend_like:
            self.forward_metadata = build_extend_metadata(batch)
            if batch.forward_mode is ForwardMode.TARGET_VERIFY and self.uses_split_verify(batch.tokens_per_request):
                self._add_verify_scratch(self.forward_metadata, batch)
        else:
            self.forward_metadata = None

    def _add_verify_scratch(self, meta: ExtendMetadata, batch: ForwardBatch) -> None:
        bs = batch.batch_size
        max_kv_len = int(batch.seq_lens_cpu.max()) if bs > 0 else 1
        splits = self.num_kv_splits(bs, max_kv_len)
        shape = (batch.num_tokens, self.ctx.num_heads, splits)
        meta.verify_splits, meta.seq_lens = splits, batch.seq_lens
        meta.attn_logits = torch.empty((*shape, self.ctx.head_dim), dtype=torch.float32, device=self.device)
        meta.attn_lse = torch.empty(shape, dtype=torch.float32, device=self.device)

    def _decode_metadata(self, batch: ForwardBatch) -> DecodeMetadata:
        bs = batch.batch_size
        max_kv_len = int(batch.seq_lens_cpu.max()) if bs > 0 else 1
        splits = self.num_kv_splits(bs, max_kv_len)
        shape = (bs, self.ctx.num_heads, splits)
        return DecodeMetadata(
            req_pool_indices=batch.req_pool_indices,
            seq_lens=batch.seq_lens,
            num_kv_splits=splits,
            attn_logits=torch.empty((*shape, self.ctx.head_dim), dtype=torch.float32, device=self.device),
            attn_lse=torch.empty(shape, dtype=torch.float32, device=self.device),
        )

    # -- forward --------------------------------------------------------------------------------

    def fuses_rotary_kv_write(self, batch: ForwardBatch) -> bool:
        """Opted in: the layer may write K/V with rotary in one op (the kernels read K/V from the pool),
        when the batch's pool is the one this backend attends over (the layer writes into the batch's)
        and is not FP8 (`rotary_kv_write` takes no scales; `set_kv_buffer` quantizes)."""
        return batch.token_to_kv_pool is self.kv_pool and not self.kv_pool.is_fp8

    def forward_extend(self, q, k, v, layer: AttentionLayerInfo, batch: ForwardBatch,
                       kv_written: bool = False) -> torch.Tensor:
        meta = self._metadata(ExtendMetadata, batch)
        if k is None or v is None:
            raise ValueError("triton attention: forward_extend expected the new tokens' k and v, got None")
        q, k, v, o = self._prepare(q, k, v, layer, batch, write_kv=not kv_written)
        if q.shape[0] == 0:
            return o
        k_buffer, v_buffer = self.kv_pool.get_kv_buffer(layer.layer_id)
        k_scale, v_scale = self.kv_pool.kv_scales(layer.layer_id)
        if meta.verify_splits is not None and layer.sliding_window <= 0:
            return verify_attention(
                q, k_buffer, v_buffer, o, self.req_to_token, meta.req_pool_indices, meta.seq_lens, meta.max_q_len,
                layer.scaling, meta.verify_splits, softcap=layer.logit_softcap, custom_mask=meta.custom_mask,
                mask_indptr=meta.mask_indptr, attn_logits=meta.attn_logits, attn_lse=meta.attn_lse,
                k_scale=k_scale, v_scale=v_scale,
            )
        return extend_attention(
            q, k, v, o, k_buffer, v_buffer, self.req_to_token, meta.req_pool_indices, meta.qo_indptr,
            meta.prefix_lens, meta.max_q_len, layer.scaling, softcap=layer.logit_softcap,
            window=layer.sliding_window, custom_mask=meta.custom_mask, mask_indptr=meta.mask_indptr,
            positions=meta.positions, k_scale=k_scale, v_scale=v_scale,
        )

    def forward_decode(self, q, k, v, layer: AttentionLayerInfo, batch: ForwardBatch,
                       kv_written: bool = False) -> torch.Tensor:
        meta = self._metadata(DecodeMetadata, batch)
        q, _, _, o = self._prepare(q, k, v, layer, batch, write_kv=not kv_written)
        if q.shape[0] == 0:
            return o
        k_buffer, v_buffer = self.kv_pool.get_kv_buffer(layer.layer_id)
        k_scale, v_scale = self.kv_pool.kv_scales(layer.layer_id)
        return decode_attention(
            q, k_buffer, v_buffer, o, self.req_to_token, meta.req_pool_indices, meta.seq_lens,
            layer.scaling, meta.num_kv_splits, softcap=layer.logit_softcap, window=layer.sliding_window,
            attn_logits=meta.attn_logits, attn_lse=meta.attn_lse, merge_counters=self.merge_counters,
            k_scale=k_scale, v_scale=v_scale,
        )

    def _metadata(self, kind: type, batch: ForwardBatch) -> Any:
        meta = self.forward_metadata
        if not isinstance(meta, kind):
            raise RuntimeError(
                f"triton attention: expected {kind.__name__} for a {batch.forward_mode.value} batch, "
                f"got {type(meta).__name__}; call init_forward_metadata(batch) first"
            )
        return meta

    def _prepare(self, q, k, v, layer: AttentionLayerInfo, batch: ForwardBatch, write_kv: bool = True):
        """Shape q/k/v as [tokens, heads, head_dim] (k/v quantized over an FP8 pool), store k/v in the
        pool (unless the layer already did, `write_kv=False`), allocate the output."""
        q = q.reshape(-1, layer.num_heads, layer.head_dim)
        if self.kv_pool.dtype != q.dtype and not self.kv_pool.is_fp8:
            raise ValueError(
                f"triton attention: expected the KV pool dtype {self.kv_pool.dtype} to equal q's dtype "
                f"(or float8_e4m3fn), got q of {q.dtype}"
            )
        if k is not None:
            k = k.reshape(-1, layer.num_kv_heads, layer.head_dim)
            v = v.reshape(-1, layer.num_kv_heads, layer.head_dim)
            if self.kv_pool.is_fp8:  # the extend kernel takes the new tokens as the pool stores them
                k, v = self.kv_pool.quantize_kv(layer.layer_id, k, v)
            if write_kv:
                self.kv_pool.set_kv_buffer(layer.layer_id, batch.out_cache_loc, k, v)
        return q, k, v, q.new_empty(q.shape)

    # -- CUDA graphs ----------------------------------------------------------------------------

    def init_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.graph_buffers = GraphBuffers(
            max_bs, max_num_tokens, self.ctx.num_heads, self.ctx.head_dim, self.ctx.max_context_len,
            lambda bs: self.num_kv_splits(bs, self.ctx.max_context_len), self.device,
            split_verify=self.uses_split_verify,
        )

    def init_metadata_for_capture(self, key: Any, batch: ForwardBatch) -> None:
        self.forward_metadata = self._graph_buffers().capture(key, batch)

    def init_metadata_for_replay(self, key: Any, batch: ForwardBatch) -> None:
        self.forward_metadata = self._graph_buffers().refresh(key, batch)

    def _graph_buffers(self) -> GraphBuffers:
        if self.graph_buffers is None:
            raise RuntimeError("triton attention: call init_graph_state(max_bs, max_num_tokens) before capture")
        return self.graph_buffers
