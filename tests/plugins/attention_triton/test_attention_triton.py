"""The "triton" attention backend under the Triton interpreter (CPU), against a plain-torch reference."""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available():
    # NOTE: TRITON_INTERPRET is process-wide and decided when a kernel is defined; setting it here would
    # turn the GPU tests collected in the same run into interpreter runs. tests/gpu covers CUDA.
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel is defined

import importlib  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402

pytest.importorskip("triton")

# NOTE: a kernel is compiled or interpreted as decided when it is defined; modules that another test
# module imported earlier in this process (tests/gpu is collected first) are reloaded, in dependency order.
for _name in ("tile_ops", "decode_kernels", "extend_kernels", "verify_kernels", "backend"):
    if f"backplane.plugins.attention_triton.{_name}" in sys.modules:
        importlib.reload(sys.modules[f"backplane.plugins.attention_triton.{_name}"])

from backplane.contracts.attention import AttentionBackendContext, AttentionLayerInfo  # noqa: E402
from backplane.contracts.batch import ForwardBatch, ForwardMode  # noqa: E402
from backplane.contracts.memory import ReqToTokenPool, TokenToKVPool  # noqa: E402
from backplane.plugins import attention_triton  # noqa: E402
from backplane.plugins.attention_triton.decode_kernels import FUSED_MERGE_MAX_SPLITS, decode_attention  # noqa: E402
from backplane.plugins.attention_triton.extend_kernels import extend_attention  # noqa: E402
from backplane.plugins.attention_triton.options import TritonAttentionOptions  # noqa: E402
from backplane.plugins.attention_triton.verify_kernels import verify_attention  # noqa: E402

TOL = {torch.float32: 2e-4, torch.float16: 1e-2}


# -- reference -----------------------------------------------------------------------------------


def reference(q, keys, values, q_pos, scaling, softcap=0.0, window=0, mask=None):
    """Plain attention of one request. q: [n, H, D]; keys/values: [S, Hkv, D]; q_pos: [n] positions.

    mask: [n, S] bool replacing causality (key p visible from query t when p <= t) when given.
    """
    group = q.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, 1)
    v = values.float().repeat_interleave(group, 1)
    scores = torch.einsum("nhd,shd->hns", q.float(), k) * scaling
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    key_pos = torch.arange(keys.shape[0])
    visible = mask.clone() if mask is not None else key_pos[None, :] <= q_pos[:, None]
    if window > 0:
        visible &= key_pos[None, :] > q_pos[:, None] - window
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1).nan_to_num(0.0)
    return torch.einsum("hns,shd->nhd", probs, v)


def tree_mask(prefix_len: int, new_len: int, gen: torch.Generator) -> torch.Tensor:
    """[new_len, prefix_len + new_len]: random prefix columns, each new token sees its tree ancestors and itself."""
    prefix = torch.rand(new_len, prefix_len, generator=gen) < 0.8
    tree = torch.eye(new_len, dtype=torch.bool)
    for i in range(1, new_len):
        parent = int(torch.randint(0, i, (1,), generator=gen))
        tree[i] |= tree[parent]
    return torch.cat([prefix, tree], 1)


# -- a KV pool in random slot order ----------------------------------------------------------------


@dataclass
class Pool:
    k_buffer: torch.Tensor  # [num_slots + 1, Hkv, D]
    v_buffer: torch.Tensor
    req_to_token: torch.Tensor  # [rows, max_ctx] int32
    req_pool_indices: torch.Tensor  # [bs]
    seq_lens: torch.Tensor  # [bs] int32

    def request_kv(self, b: int):
        slots = self.req_to_token[self.req_pool_indices[b], : int(self.seq_lens[b])].long()
        return self.k_buffer[slots], self.v_buffer[slots]


def make_pool(seq_lens, num_kv_heads, head_dim, dtype, gen) -> Pool:
    total, bs = sum(seq_lens), len(seq_lens)
    num_slots = total + 7
    shape = (num_slots + 1, num_kv_heads, head_dim)
    k_buffer = torch.randn(shape, generator=gen).to(dtype)
    v_buffer = torch.randn(shape, generator=gen).to(dtype)
    slots = torch.randperm(num_slots, generator=gen)[:total] + 1  # slot 0 is never handed out
    req_to_token = torch.zeros((bs + 2, max(seq_lens) + 5), dtype=torch.int32)
    rows = torch.randperm(bs + 2, generator=gen)[:bs]
    starts = [0, *torch.tensor(seq_lens).cumsum(0).tolist()]
    for b, n in enumerate(seq_lens):
        req_to_token[rows[b], :n] = slots[starts[b] : starts[b] + n].int()
    return Pool(k_buffer, v_buffer, req_to_token, rows, torch.tensor(seq_lens, dtype=torch.int32))


# -- decode kernel ---------------------------------------------------------------------------------

DECODE_CASES = [
    # seq_lens, num_heads, num_kv_heads, head_dim, dtype, splits, softcap, window
    ([1], 4, 4, 64, torch.float32, 1, 0.0, 0),
    ([1, 7, 129], 8, 2, 64, torch.float32, 4, 0.0, 0),
    ([1, 7, 129], 8, 1, 128, torch.float16, 3, 0.0, 0),
    ([5, 129, 64], 8, 8, 32, torch.float16, 8, 30.0, 0),
    ([9, 129, 100], 4, 1, 32, torch.float32, 2, 0.0, 17),
    ([3, 11, 1, 8, 20, 13, 2, 7, 33, 1, 6, 5, 9, 17, 4, 12, 30], 4, 1, 32, torch.float32, 2, 0.0, 0),
    ([1000, 130], 2, 1, 64, torch.float16, 8, 0.0, 0),
    ([80, 129], 4, 2, 80, torch.float32, 3, 5.0, 33),  # head dim padded to 128
]


@pytest.mark.parametrize("seq_lens,heads,kv_heads,head_dim,dtype,splits,softcap,window", DECODE_CASES)
def test_decode_kernel(seq_lens, heads, kv_heads, head_dim, dtype, splits, softcap, window):
    gen = torch.Generator().manual_seed(len(seq_lens) * 1000 + head_dim + splits)
    pool = make_pool(seq_lens, kv_heads, head_dim, dtype, gen)
    q = torch.randn((len(seq_lens), heads, head_dim), generator=gen).to(dtype)
    scaling = 1.0 if softcap else head_dim**-0.5
    o = torch.full_like(q, float("nan"))
    decode_attention(q, pool.k_buffer, pool.v_buffer, o, pool.req_to_token, pool.req_pool_indices,
                     pool.seq_lens, scaling, splits, softcap=softcap, window=window)
    for b, n in enumerate(seq_lens):
        keys, values = pool.request_kv(b)
        ref = reference(q[b : b + 1], keys, values, torch.tensor([n - 1]), scaling, softcap, window)
        torch.testing.assert_close(o[b : b + 1].float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("seq_lens,heads,kv_heads,head_dim,dtype,splits,softcap,window",
                         [c for c in DECODE_CASES if c[5] <= FUSED_MERGE_MAX_SPLITS] + [
                             ([300, 1, 64, 129, 2], 8, 2, 64, torch.float32, 4, 0.0, 0),  # some use fewer slices
                             ([200, 17], 4, 4, 128, torch.float16, 3, 0.0, 40)])
def test_decode_kernel_merging_in_the_first_kernel(seq_lens, heads, kv_heads, head_dim, dtype, splits, softcap,
                                                   window):
    """With merge counters and few splits the last slice of each group merges (one launch); the
    result equals the reference and every counter is back to zero (ready for the next launch)."""
    gen = torch.Generator().manual_seed(len(seq_lens) * 999 + head_dim + splits)
    pool = make_pool(seq_lens, kv_heads, head_dim, dtype, gen)
    q = torch.randn((len(seq_lens), heads, head_dim), generator=gen).to(dtype)
    scaling = 1.0 if softcap else head_dim**-0.5
    counters = torch.zeros(len(seq_lens) * kv_heads + 3, dtype=torch.int32)
    for _ in range(2):  # the second launch finds the counters re-armed by the first
        o = torch.full_like(q, float("nan"))
        decode_attention(q, pool.k_buffer, pool.v_buffer, o, pool.req_to_token, pool.req_pool_indices,
                         pool.seq_lens, scaling, splits, softcap=softcap, window=window, merge_counters=counters)
        assert not bool(counters.any()), "a merge counter was left armed"
        for b, n in enumerate(seq_lens):
            keys, values = pool.request_kv(b)
            ref = reference(q[b : b + 1], keys, values, torch.tensor([n - 1]), scaling, softcap, window)
            torch.testing.assert_close(o[b : b + 1].float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_decode_kernel_too_few_merge_counters_is_an_error():
    gen = torch.Generator().manual_seed(3)
    pool = make_pool([5, 9], 2, 32, torch.float32, gen)
    q = torch.randn((2, 4, 32), generator=gen)
    with pytest.raises(ValueError, match=r"merge_counters holds 3 counters; expected at least batch 2 x 2 KV heads"):
        decode_attention(q, pool.k_buffer, pool.v_buffer, torch.empty_like(q), pool.req_to_token,
                         pool.req_pool_indices, pool.seq_lens, 0.3, 2, merge_counters=torch.zeros(3, dtype=torch.int32))


def test_decode_kernel_uses_preallocated_scratch_larger_than_needed():
    gen = torch.Generator().manual_seed(7)
    pool = make_pool([129, 40, 3], 2, 32, torch.float32, gen)
    q = torch.randn((3, 4, 32), generator=gen)
    logits = torch.full((5, 4, 16, 32), float("nan"))
    lse = torch.full((5, 4, 16), float("nan"))
    o = decode_attention(q, pool.k_buffer, pool.v_buffer, torch.empty_like(q), pool.req_to_token,
                         pool.req_pool_indices, pool.seq_lens, 0.3, 4, attn_logits=logits, attn_lse=lse)
    for b in range(3):
        keys, values = pool.request_kv(b)
        ref = reference(q[b : b + 1], keys, values, pool.seq_lens[b : b + 1] - 1, 0.3)
        torch.testing.assert_close(o[b : b + 1], ref, atol=2e-4, rtol=2e-4)


# -- verify kernel (split-KV, several tokens per request) ----------------------------------------------

VERIFY_CASES = [
    # prefix_lens, q_len, num_heads, num_kv_heads, head_dim, dtype, splits, softcap, custom mask
    ([1], 1, 4, 4, 64, torch.float32, 1, 0.0, True),
    ([40, 7, 129], 4, 8, 2, 64, torch.float32, 3, 0.0, True),
    ([40, 7, 129], 4, 8, 2, 64, torch.float32, 3, 0.0, False),  # causal chain
    ([63, 200], 8, 8, 1, 128, torch.float16, 4, 0.0, True),  # 8 tokens x 8 heads = 64 rows
    ([5, 90, 17], 6, 4, 1, 32, torch.float16, 8, 20.0, True),  # more splits than some requests use
    ([60, 1], 8, 4, 2, 80, torch.float32, 2, 0.0, True),  # head dim padded; rows that see nothing in a split
]


@pytest.mark.parametrize("prefix_lens,q_len,heads,kv_heads,head_dim,dtype,splits,softcap,use_mask", VERIFY_CASES)
def test_verify_kernel(prefix_lens, q_len, heads, kv_heads, head_dim, dtype, splits, softcap, use_mask):
    gen = torch.Generator().manual_seed(sum(prefix_lens) * 7 + q_len + head_dim + splits)
    seq_lens = [p + q_len for p in prefix_lens]
    pool = make_pool(seq_lens, kv_heads, head_dim, dtype, gen)
    q = torch.randn((len(seq_lens) * q_len, heads, head_dim), generator=gen).to(dtype)
    scaling = 1.0 if softcap else head_dim**-0.5
    masks = [tree_mask(p, q_len, gen) for p in prefix_lens] if use_mask else None
    custom_mask = torch.cat([m.flatten() for m in masks]) if use_mask else None
    sizes = torch.tensor([q_len * n for n in seq_lens])
    mask_indptr = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)]) if use_mask else None
    o = torch.full_like(q, float("nan"))
    verify_attention(q, pool.k_buffer, pool.v_buffer, o, pool.req_to_token, pool.req_pool_indices,
                     pool.seq_lens, q_len, scaling, splits, softcap=softcap, custom_mask=custom_mask,
                     mask_indptr=mask_indptr)
    for b, (p, n) in enumerate(zip(prefix_lens, seq_lens)):
        keys, values = pool.request_kv(b)
        rows = slice(b * q_len, (b + 1) * q_len)
        ref = reference(q[rows], keys, values, torch.arange(p, n), scaling, softcap, 0,
                        masks[b] if use_mask else None)
        torch.testing.assert_close(o[rows].float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


# -- extend kernel ---------------------------------------------------------------------------------

EXTEND_CASES = [
    # prefix_lens, new_lens, num_heads, num_kv_heads, head_dim, dtype, softcap, window, custom mask
    ([0], [7], 4, 4, 64, torch.float32, 0.0, 0, False),
    ([0, 5, 129], [1, 7, 20], 8, 2, 64, torch.float32, 0.0, 0, False),
    ([0, 5, 129], [1, 7, 20], 8, 1, 128, torch.float16, 0.0, 0, False),
    ([3, 0, 40], [70, 33, 5], 8, 8, 32, torch.float16, 20.0, 0, False),
    ([100, 0, 7], [40, 50, 1], 4, 1, 32, torch.float32, 0.0, 29, False),
    ([40, 0, 7], [4, 9, 6], 8, 2, 32, torch.float32, 0.0, 0, True),
    ([20, 0], [130, 45], 2, 1, 32, torch.float32, 0.0, 40, False),  # window skips whole key blocks
    ([129, 1], [8, 16], 4, 1, 64, torch.float16, 10.0, 37, True),
    ([1] * 5 + [0] * 6 + [9] * 6, [3, 1, 7, 2, 5, 1, 4, 6, 8, 1, 2, 3, 9, 1, 2, 5, 4], 4, 1, 32,
     torch.float32, 0.0, 0, False),
    ([0], [1000], 1, 1, 32, torch.float32, 0.0, 0, False),
    ([50, 3], [40, 20], 4, 2, 80, torch.float32, 0.0, 0, False),  # head dim padded to 128
]


def run_extend(prefix_lens, new_lens, heads, kv_heads, head_dim, dtype, softcap, window, use_mask, seed):
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + n for p, n in zip(prefix_lens, new_lens)]
    pool = make_pool(seq_lens, kv_heads, head_dim, dtype, gen)
    num_tokens = sum(new_lens)
    q = torch.randn((num_tokens, heads, head_dim), generator=gen).to(dtype)
    # The new tokens' k/v are the pool entries at their positions (as if just written).
    k_new, v_new, masks, refs = [], [], [], []
    scaling = 1.0 if softcap else head_dim**-0.5
    starts = [0, *torch.tensor(new_lens).cumsum(0).tolist()]
    for b, (p, n) in enumerate(zip(prefix_lens, new_lens)):
        keys, values = pool.request_kv(b)
        k_new.append(keys[p:])
        v_new.append(values[p:])
        mask = tree_mask(p, n, gen) if use_mask else None
        masks.append(mask)
        q_pos = torch.arange(p, p + n)
        refs.append(reference(q[starts[b] : starts[b + 1]], keys, values, q_pos, scaling, softcap, window, mask))
    custom_mask = torch.cat([m.flatten() for m in masks]) if use_mask else None
    mask_sizes = torch.tensor([n * (p + n) for p, n in zip(prefix_lens, new_lens)])
    mask_indptr = torch.cat([torch.zeros(1, dtype=torch.int64), mask_sizes.cumsum(0)]) if use_mask else None
    o = torch.full_like(q, float("nan"))
    extend_attention(q, torch.cat(k_new), torch.cat(v_new), o, pool.k_buffer, pool.v_buffer,
                     pool.req_to_token, pool.req_pool_indices,
                     torch.tensor(starts, dtype=torch.int32), torch.tensor(prefix_lens, dtype=torch.int32),
                     max(new_lens), scaling, softcap=softcap, window=window, custom_mask=custom_mask,
                     mask_indptr=mask_indptr)
    return o, torch.cat(refs)


@pytest.mark.parametrize("prefix_lens,new_lens,heads,kv_heads,head_dim,dtype,softcap,window,use_mask",
                         EXTEND_CASES)
def test_extend_kernel(prefix_lens, new_lens, heads, kv_heads, head_dim, dtype, softcap, window, use_mask):
    seed = sum(prefix_lens) + 3 * sum(new_lens) + head_dim
    o, ref = run_extend(prefix_lens, new_lens, heads, kv_heads, head_dim, dtype, softcap, window, use_mask, seed)
    torch.testing.assert_close(o.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_extend_kernel_row_with_no_visible_key_is_zero():
    gen = torch.Generator().manual_seed(3)
    pool = make_pool([6], 1, 32, torch.float32, gen)
    q = torch.randn((4, 2, 32), generator=gen)
    keys, values = pool.request_kv(0)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[2] = False
    o = extend_attention(q, keys[2:], values[2:], torch.empty_like(q), pool.k_buffer, pool.v_buffer,
                         pool.req_to_token, pool.req_pool_indices, torch.tensor([0, 4], dtype=torch.int32),
                         torch.tensor([2], dtype=torch.int32), 4, 0.2, custom_mask=mask.flatten(),
                         mask_indptr=torch.tensor([0, 24]))
    assert torch.equal(o[2], torch.zeros_like(o[2]))
    torch.testing.assert_close(o, reference(q, keys, values, torch.arange(2, 6), 0.2, mask=mask), atol=2e-4,
                               rtol=2e-4)


# -- the backend through ForwardBatch --------------------------------------------------------------

HEADS, KV_HEADS, HEAD_DIM, LAYER = 4, 2, 32, AttentionLayerInfo(1, 4, 2, 32, scaling=0.25)


def make_backend(dtype=torch.float32, options=None):
    req_pool = ReqToTokenPool(8, 300, "cpu")
    kv_pool = TokenToKVPool(500, 2, KV_HEADS, HEAD_DIM, dtype, "cpu")
    ctx = AttentionBackendContext(HEADS, KV_HEADS, HEAD_DIM, 2, dtype, torch.device("cpu"), req_pool, kv_pool,
                                  max_context_len=300, options=options)
    specs = []
    attention_triton.backplane_register_attention_backends(register=specs.append)
    (spec,) = specs
    assert spec.available() is None and "cpu" in spec.platforms
    return spec.factory(ctx)


class Requests:
    """Requests with random cached prefixes in a shuffled pool; `step` builds the next ForwardBatch."""

    def __init__(self, backend, prefix_lens, gen):
        self.backend, self.gen = backend, gen
        self.req_pool, self.kv_pool = backend.ctx.req_to_token_pool, backend.ctx.token_to_kv_pool
        self.rows = [self.req_pool.alloc() for _ in prefix_lens]
        self.lens = list(prefix_lens)
        self.free_slots = self.kv_pool.alloc(400)[torch.randperm(400, generator=gen)].tolist()
        loc = self._place([0] * len(prefix_lens), prefix_lens)
        shape = (len(loc), KV_HEADS, HEAD_DIM)
        dtype = self.kv_pool.dtype
        self.kv_pool.set_kv_buffer(LAYER.layer_id, loc, torch.randn(shape, generator=gen).to(dtype),
                                   torch.randn(shape, generator=gen).to(dtype))

    def _place(self, starts, counts) -> torch.Tensor:
        loc = []
        for row, start, n in zip(self.rows, starts, counts):
            slots = [self.free_slots.pop() for _ in range(n)]
            self.req_pool.req_to_token[row, start : start + n] = torch.tensor(slots, dtype=torch.int32)
            loc += slots
        return torch.tensor(loc, dtype=torch.int64)

    def step(self, mode, new_lens, masked=False, pad_to=0):
        prefix = list(self.lens)
        loc = self._place(prefix, new_lens)
        self.lens = [p + n for p, n in zip(prefix, new_lens)]
        self.new_lens = list(new_lens)
        bs, pad = len(new_lens), max(pad_to - len(new_lens), 0)
        per_request = new_lens[0]
        seq_lens = torch.tensor(self.lens + [1] * pad, dtype=torch.int32)
        masks = [tree_mask(p, n, self.gen).flatten() for p, n in zip(prefix, new_lens)] if masked else None
        has_lens = mode in (ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND)
        new = torch.tensor(new_lens, dtype=torch.int32)
        return ForwardBatch(
            forward_mode=mode, batch_size=bs + pad,
            input_ids=torch.zeros(int(new.sum()) + pad * per_request, dtype=torch.int64),
            positions=torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, new_lens)]),
            req_pool_indices=torch.tensor(self.rows + [self.rows[0]] * pad),
            seq_lens=seq_lens, seq_lens_cpu=seq_lens.clone(),
            out_cache_loc=torch.cat([loc, torch.zeros(pad * per_request, dtype=torch.int64)]),
            req_to_token_pool=self.req_pool, token_to_kv_pool=self.kv_pool,
            extend_prefix_lens=torch.tensor(prefix, dtype=torch.int32) if has_lens else None,
            extend_seq_lens=new if has_lens else None,
            extend_prefix_lens_cpu=torch.tensor(prefix, dtype=torch.int32) if has_lens else None,
            extend_seq_lens_cpu=new.clone() if has_lens else None,
            custom_mask=torch.cat(masks) if masked else None,
        )

    def expected(self, batch, q, masked):
        """Reference output of the batch's real requests, reading every key back from the pool."""
        k_buf, v_buf = self.kv_pool.get_kv_buffer(LAYER.layer_id)
        outs, start, mask_start = [], 0, 0
        for row, seq_len, n in zip(self.rows, self.lens, self.new_lens):
            slots = self.req_pool.req_to_token[row, :seq_len].long()
            mask = None
            if masked:
                mask = batch.custom_mask[mask_start : mask_start + n * seq_len].view(n, seq_len)
                mask_start += n * seq_len
            q_pos = torch.arange(seq_len - n, seq_len)
            outs.append(reference(q[start : start + n], k_buf[slots], v_buf[slots], q_pos, LAYER.scaling,
                                  mask=mask))
            start += n
        return torch.cat(outs)


def run_layer(backend, batch, gen, init=True):
    dtype = backend.ctx.dtype
    n = batch.num_tokens
    q = torch.randn((n, HEADS, HEAD_DIM), generator=gen).to(dtype)
    k = torch.randn((n, KV_HEADS, HEAD_DIM), generator=gen).to(dtype)
    v = torch.randn((n, KV_HEADS, HEAD_DIM), generator=gen).to(dtype)
    if init:
        backend.init_forward_metadata(batch)
    return q, k, v, backend.forward(q, k, v, LAYER, batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_backend_extend_then_decode(dtype):
    gen = torch.Generator().manual_seed(11)
    backend = make_backend(dtype)
    reqs = Requests(backend, [0, 5, 40], gen)
    for mode, new_lens in [(ForwardMode.EXTEND, [7, 1, 9]), (ForwardMode.DECODE, [1, 1, 1])]:
        batch = reqs.step(mode, new_lens)
        q, k, v, o = run_layer(backend, batch, gen)
        k_buf, v_buf = reqs.kv_pool.get_kv_buffer(LAYER.layer_id)
        assert torch.equal(k_buf[batch.out_cache_loc], k) and torch.equal(v_buf[batch.out_cache_loc], v)
        torch.testing.assert_close(o.float(), reqs.expected(batch, q, False), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("mode,new_lens,masked", [
    (ForwardMode.TARGET_VERIFY, [4, 4, 4], True),
    (ForwardMode.TARGET_VERIFY, [3, 3, 3], False),
    (ForwardMode.DRAFT_EXTEND, [2, 5, 1], True),
])
def test_backend_speculative_modes(mode, new_lens, masked):
    gen = torch.Generator().manual_seed(12)
    backend = make_backend()
    reqs = Requests(backend, [9, 1, 70], gen)
    batch = reqs.step(mode, new_lens, masked=masked)
    q, _, _, o = run_layer(backend, batch, gen)
    torch.testing.assert_close(o, reqs.expected(batch, q, masked), atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("mode,per_request,masked", [
    (ForwardMode.DECODE, 1, False),
    (ForwardMode.TARGET_VERIFY, 4, True),
    (ForwardMode.TARGET_VERIFY, 2, False),
])
def test_graph_metadata_path_matches_eager(mode, per_request, masked):
    """Capture binds static buffers, replay refreshes them in place for a new padded batch."""
    gen = torch.Generator().manual_seed(13)
    backend = make_backend()
    reqs = Requests(backend, [3, 60, 17], gen)
    backend.init_graph_state(max_bs=8, max_num_tokens=32)
    capture = reqs.step(mode, [per_request] * 3, masked=masked, pad_to=4)
    backend.init_metadata_for_capture(("key", mode), capture)
    rows = backend.forward_metadata.req_pool_indices  # decode: the capture batch's own; verify: the buffers'
    assert rows.data_ptr() == (capture.req_pool_indices if mode is ForwardMode.DECODE
                               else backend.graph_buffers.req_pool_indices).data_ptr()
    run_layer(backend, capture, gen, init=False)
    for _ in range(2):  # replay twice with new lengths
        batch = reqs.step(mode, [per_request] * 3, masked=masked, pad_to=4)
        backend.init_metadata_for_replay(("key", mode), batch)
        assert backend.forward_metadata.req_pool_indices.data_ptr() == rows.data_ptr()
        q, k, v, o_graph = run_layer(backend, batch, gen, init=False)
        real = 3 * per_request
        torch.testing.assert_close(o_graph[:real], reqs.expected(batch, q, masked), atol=2e-4, rtol=2e-4)
        backend.init_forward_metadata(batch)
        o_eager = backend.forward(q, k, v, LAYER, batch)
        torch.testing.assert_close(o_graph[:real], o_eager[:real], atol=2e-5, rtol=2e-5)


def test_backend_errors_name_the_problem():
    gen = torch.Generator().manual_seed(14)
    backend = make_backend()
    batch = Requests(backend, [4], gen).step(ForwardMode.DECODE, [1])
    q = torch.randn(1, HEADS, HEAD_DIM)
    with pytest.raises(RuntimeError, match="init_forward_metadata"):
        backend.forward_decode(q, None, None, LAYER, batch)
    backend.init_forward_metadata(batch)
    with pytest.raises(ValueError, match="expected the KV pool dtype"):
        backend.forward_decode(q.half(), None, None, LAYER, batch)
    with pytest.raises(RuntimeError, match="init_graph_state"):
        backend.init_metadata_for_capture("k", batch)


# -- registration and options ----------------------------------------------------------------------


def test_settings_group_and_options():
    groups = {}
    attention_triton.backplane_register_settings(register=groups.__setitem__)
    assert groups == {"triton-attention": TritonAttentionOptions}
    assert TritonAttentionOptions().num_kv_splits == 0
    with pytest.raises(ValueError, match="expected at most max_kv_splits=8, got 9"):
        TritonAttentionOptions(num_kv_splits=9, max_kv_splits=8)


def test_fixed_num_kv_splits_option_is_used():
    backend = make_backend(options=TritonAttentionOptions(num_kv_splits=5))
    assert backend.num_kv_splits(batch_size=64, max_kv_len=4096) == 5
    auto = make_backend()
    assert auto.num_kv_splits(batch_size=1, max_kv_len=4096) > auto.num_kv_splits(batch_size=64, max_kv_len=4096)


def test_plugin_module_imports_no_triton():
    import subprocess
    import sys

    code = "import sys, backplane.plugins.attention_triton; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
