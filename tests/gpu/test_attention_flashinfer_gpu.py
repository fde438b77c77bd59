"""The flashinfer backend and custom ops on a GPU, against plain-torch references written here.

FlashInfer JIT-compiles each kernel variant on first use (~25 s each), so the grid is shaped to
keep variants few: bf16 head dim 128 is the main grid (every mode, batch 1/3/17, lengths 1 to
1000, GQA 1/4/8); head dim 64 and fp16 run decode and one extend; soft-cap and window one case each.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math

import pytest
import torch

from backplane.contracts.attention import AttentionBackendContext, AttentionLayerInfo
from backplane.contracts.batch import ForwardBatch, ForwardMode
from backplane.contracts.memory import ReqToTokenPool, TokenToKVPool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="flashinfer is not installed"),
]

MAX_CONTEXT = 1024
TOL = {torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float16: dict(atol=6e-3, rtol=6e-3)}


# -- batches over a KV pool with shuffled slots ----------------------------------------------------


@dataclasses.dataclass
class Pools:
    kv: TokenToKVPool
    req: ReqToTokenPool
    allocated: torch.Tensor | None = None  # the slots of the latest batch, freed by the next one


def make_pools(num_slots, num_kv_heads, head_dim, dtype, num_layers=2) -> Pools:
    kv = TokenToKVPool(num_slots, num_layers, num_kv_heads, head_dim, dtype, "cuda")
    for layer in range(num_layers):  # random everywhere: a wrong slot shows up as a wrong result
        kv.k_buffers[layer].normal_()
        kv.v_buffers[layer].normal_()
    return Pools(kv, ReqToTokenPool(24, MAX_CONTEXT, "cuda"))


def make_batch(pools: Pools, mode, seq_lens, new_lens, mask=False) -> ForwardBatch:
    """A batch whose prefixes are cached; its new tokens' slots are in out_cache_loc and req_to_token."""
    bs, total = len(seq_lens), sum(seq_lens)
    if pools.allocated is not None:
        pools.kv.free(pools.allocated)
    pools.allocated = pools.kv.alloc(total).cuda()
    slots = pools.allocated[torch.randperm(total, device="cuda")]
    rows = torch.randperm(pools.req.size)[:bs]
    out_cache_loc, start = [], 0
    for row, seq_len, new in zip(rows.tolist(), seq_lens, new_lens):
        pools.req.req_to_token[row, :seq_len] = slots[start : start + seq_len].int()
        out_cache_loc.append(slots[start + seq_len - new : start + seq_len])
        start += seq_len
    custom_mask = mask_indptr = None
    if mask:  # a random tree: each draft token sees the prefix, itself and some earlier drafts
        blocks = []
        for s, n in zip(seq_lens, new_lens):
            block = torch.ones(n, s, dtype=torch.bool, device="cuda")
            block[:, s - n :] = torch.rand(n, n, device="cuda").tril() > 0.5
            block[torch.arange(n), torch.arange(s - n, s)] = True
            blocks.append(block.flatten())
        custom_mask = torch.cat(blocks)
        mask_indptr = torch.tensor([0] + [n * s for n, s in zip(new_lens, seq_lens)]).cumsum(0).int().cuda()
    seq_cpu, new_cpu = torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(new_lens, dtype=torch.int32)
    extend = not mode.is_decode
    return ForwardBatch(
        forward_mode=mode,
        batch_size=bs,
        input_ids=torch.zeros(sum(new_lens), dtype=torch.int64, device="cuda"),
        positions=torch.cat([torch.arange(s - n, s) for s, n in zip(seq_lens, new_lens)]).cuda(),
        req_pool_indices=rows.cuda(),
        seq_lens=seq_cpu.cuda(),
        seq_lens_cpu=seq_cpu,
        out_cache_loc=torch.cat(out_cache_loc),
        req_to_token_pool=pools.req,
        token_to_kv_pool=pools.kv,
        extend_prefix_lens=(seq_cpu - new_cpu).cuda() if extend else None,
        extend_seq_lens=new_cpu.cuda() if extend else None,
        extend_prefix_lens_cpu=seq_cpu - new_cpu if extend else None,
        extend_seq_lens_cpu=new_cpu if extend else None,
        custom_mask=custom_mask,
        mask_indptr=mask_indptr,
    )


def make_backend(pools: Pools, num_heads, dtype, **options):
    from backplane.plugins.attention_flashinfer.backend import FlashInferAttnBackend
    from backplane.plugins.attention_flashinfer.options import FlashInferOptions

    ctx = AttentionBackendContext(
        num_heads=num_heads, num_kv_heads=pools.kv.num_kv_heads, head_dim=pools.kv.head_dim,
        num_layers=pools.kv.num_layers, dtype=dtype, device=torch.device("cuda"),
        req_to_token_pool=pools.req, token_to_kv_pool=pools.kv, max_context_len=MAX_CONTEXT,
        options=FlashInferOptions(**options),
    )
    return FlashInferAttnBackend(ctx)


# -- the reference -----------------------------------------------------------------------------------


def reference_attention(q, layer: AttentionLayerInfo, batch: ForwardBatch) -> torch.Tensor:
    """Plain attention per request in fp32 over the pool (read after the new K/V were written)."""
    k_buf, v_buf = batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
    seq_lens = batch.seq_lens_cpu.tolist()
    if batch.forward_mode.is_decode:
        new_lens = [1] * batch.batch_size
    else:
        new_lens = batch.extend_seq_lens_cpu.tolist()
    out, q_start, mask_start = torch.empty_like(q), 0, 0
    group = layer.num_heads // layer.num_kv_heads
    for row, s, n in zip(batch.req_pool_indices.tolist(), seq_lens, new_lens):
        slots = batch.req_to_token_pool.req_to_token[row, :s].long()
        keys = k_buf[slots].float().repeat_interleave(group, 1)  # [s, H, D]
        values = v_buf[slots].float().repeat_interleave(group, 1)
        scores = torch.einsum("nhd,shd->hns", q[q_start : q_start + n].float(), keys) * layer.scaling
        if layer.logit_softcap > 0:
            scores = layer.logit_softcap * torch.tanh(scores / layer.logit_softcap)
        q_pos = torch.arange(s - n, s, device="cuda")[:, None]
        k_pos = torch.arange(s, device="cuda")[None, :]
        if batch.custom_mask is not None:
            visible = batch.custom_mask[mask_start : mask_start + n * s].view(n, s)
            mask_start += n * s
        else:
            visible = k_pos <= q_pos
        if layer.sliding_window > 0:
            visible = visible & (k_pos > q_pos - layer.sliding_window)
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[q_start : q_start + n] = torch.einsum("hns,shd->nhd", probs, values).to(q.dtype)
        q_start += n
    return out


def run_layers(backend, batch, layers, dtype):
    """Run each layer (fresh q/k/v) through the backend; compare with the reference."""
    backend.init_forward_metadata(batch)
    hkv, d = batch.token_to_kv_pool.num_kv_heads, batch.token_to_kv_pool.head_dim
    for layer in layers:
        q = torch.randn(batch.num_tokens, layer.num_heads, d, dtype=dtype, device="cuda")
        k = torch.randn(batch.num_tokens, hkv, d, dtype=dtype, device="cuda")
        v = torch.randn(batch.num_tokens, hkv, d, dtype=dtype, device="cuda")
        got = backend.forward(q, k, v, layer, batch)
        assert got.shape == q.shape and got.dtype == dtype
        torch.testing.assert_close(got, reference_attention(q, layer, batch), **TOL[dtype])


def _lens(n, seed):
    """n lengths cycling through 1, 7, 129, 1000 with some noise."""
    gen = torch.Generator().manual_seed(seed)
    base = [1, 7, 129, 1000]
    return [max(1, min(MAX_CONTEXT, base[i % 4] - int(torch.randint(0, 3, (1,), generator=gen)))) for i in range(n)]


E, D, V, X = ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND

MAIN_GRID = [  # bf16, head dim 128: (mode, num_heads, num_kv_heads, seq_lens, new_lens, mask)
    (E, 32, 8, [1, 129, 1000], [1, 129, 1000], False),  # no prefix: ragged only
    (E, 32, 8, [7, 129, 1000, 3], [7, 100, 17, 1], False),  # prefixes (one empty): ragged + paged, merged
    (E, 8, 8, _lens(17, 1), [max(1, n // 3) for n in _lens(17, 1)], False),  # batch 17, GQA 1
    (E, 32, 4, [129, 1000, 7], [5, 3, 7], True),  # extend with a custom mask
    (D, 32, 8, [1000], [1], False),  # batch 1, GQA 4: CUDA-core decode kernel (auto)
    (D, 8, 8, [1, 7, 129], [1, 1, 1], False),  # GQA 1: CUDA-core decode kernel
    (D, 32, 4, _lens(17, 2), [1] * 17, False),  # batch 17, GQA 8: tensor-core decode
    (V, 32, 8, [10, 129, 1000], [4, 4, 4], True),  # random tree mask
    (X, 32, 8, [10, 129, 1000], [1, 3, 2], False),
]


@pytest.mark.parametrize("mode, num_heads, num_kv_heads, seq_lens, new_lens, mask", MAIN_GRID)
def test_modes_bf16_head128(mode, num_heads, num_kv_heads, seq_lens, new_lens, mask):
    torch.manual_seed(0)
    pools = make_pools(sum(seq_lens) + 8, num_kv_heads, 128, torch.bfloat16)
    batch = make_batch(pools, mode, seq_lens, new_lens, mask)
    backend = make_backend(pools, num_heads, torch.bfloat16)
    layers = [AttentionLayerInfo(i, num_heads, num_kv_heads, 128, 128**-0.5) for i in range(2)]
    run_layers(backend, batch, layers, torch.bfloat16)
    run_layers(backend, batch, layers, torch.bfloat16)  # second pass: configs planned up front


@pytest.mark.parametrize("dtype, head_dim", [(torch.bfloat16, 64), (torch.float16, 128)])
@pytest.mark.parametrize("mode, seq_lens, new_lens", [(D, [1, 7, 129], [1, 1, 1]), (E, [129, 1000, 7], [9, 1000, 7])])
def test_other_head_dim_and_fp16(dtype, head_dim, mode, seq_lens, new_lens):
    torch.manual_seed(1)
    pools = make_pools(sum(seq_lens) + 8, 4, head_dim, dtype)
    batch = make_batch(pools, mode, seq_lens, new_lens)
    layer = AttentionLayerInfo(0, 16, 4, head_dim, head_dim**-0.5)
    run_layers(make_backend(pools, 16, dtype), batch, [layer], dtype)


@pytest.mark.parametrize("mode, seq_lens, new_lens", [(D, [3, 129, 1000], [1, 1, 1]), (E, [3, 129, 1000], [3, 9, 500])])
def test_softcap_and_window_layers(mode, seq_lens, new_lens):
    """Layer 0 soft-capped, layer 1 with a sliding window: two plans in one forward pass."""
    torch.manual_seed(2)
    pools = make_pools(sum(seq_lens) + 8, 8, 128, torch.bfloat16)
    batch = make_batch(pools, mode, seq_lens, new_lens)
    layers = [
        AttentionLayerInfo(0, 32, 8, 128, 0.1, logit_softcap=2.0),
        AttentionLayerInfo(1, 32, 8, 128, 128**-0.5, sliding_window=64),
    ]
    run_layers(make_backend(pools, 32, torch.bfloat16), batch, layers, torch.bfloat16)


# -- CUDA graphs -----------------------------------------------------------------------------------


def _capture(backend, key, static, layer, q, k, v) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """One layer's attention over `static` captured in a CUDA graph under `key`, after a warm-up
    forward on a side stream (it learns the layer config and plans it); (graph, its output)."""
    backend.init_metadata_for_capture(key, static)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: learns the layer config, plans it
        backend.forward(q, k, v, layer, static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, layer, static)
    return graph, out


def _replay_equals_eager(backend, key, replay, fresh, graph, out, layer, q, k, v) -> None:
    """Replay `graph` for `replay` (the static batch with `fresh`'s host lengths) and compare its output
    with an eager forward over `fresh` and with the reference."""
    backend.init_metadata_for_replay(key, replay)
    graph.replay()
    replayed = out.clone()
    backend.init_forward_metadata(fresh)
    eager = backend.forward(q, k, v, layer, fresh)
    torch.testing.assert_close(replayed, eager, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(replayed, reference_attention(q, layer, fresh), **TOL[q.dtype])


def _capture_and_replay(mode, capture_lens, replay_lens, tokens_per_request, mask):
    """Capture one layer in a real CUDA graph, replay it for other lengths, compare with eager + reference."""
    torch.manual_seed(3)
    dtype, num_heads, hkv = torch.bfloat16, 32, 8
    pools = make_pools(sum(max(a, b) for a, b in zip(capture_lens, replay_lens)) * 2 + 8, hkv, 128, dtype)
    layer = AttentionLayerInfo(0, num_heads, hkv, 128, 128**-0.5)
    backend = make_backend(pools, num_heads, dtype)
    bs = len(capture_lens)
    backend.init_graph_state(max_bs=bs, max_num_tokens=bs * tokens_per_request)
    new = [tokens_per_request] * bs
    static = make_batch(pools, mode, capture_lens, new, mask)
    num_tokens = bs * tokens_per_request
    q, k, v = (torch.randn(num_tokens, h, 128, dtype=dtype, device="cuda") for h in (num_heads, hkv, hkv))
    graph, out = _capture(backend, "key", static, layer, q, k, v)
    for lens in (replay_lens, capture_lens):
        fresh = make_batch(pools, mode, lens, new, mask)
        for name in ("req_pool_indices", "seq_lens", "out_cache_loc"):
            getattr(static, name).copy_(getattr(fresh, name))
        for t in (q, k, v):
            t.normal_()
        replay = dataclasses.replace(static, seq_lens_cpu=fresh.seq_lens_cpu, custom_mask=fresh.custom_mask)
        _replay_equals_eager(backend, "key", replay, fresh, graph, out, layer, q, k, v)
    if mode is D:  # both replays re-planned by the short road (it matched plan() at capture)
        assert backend._graph_caches["key"].fast_replans == 2


@dataclasses.dataclass(frozen=True)
class _Bucket:  # what the backend reads of the graph runner's key: an EXTEND graph's is ragged
    tokens: int
    ragged: bool = True


def test_extend_graph_replay_equals_eager_by_the_short_paged_replan():
    """An EXTEND graph (64 tokens over 2 requests) replayed for other splits and prefixes equals eager
    and the reference, and from the first replay on its paged wrapper re-plans by the short road
    (`replan_paged`, proved equal to plan() at capture on this FlashInfer)."""
    torch.manual_seed(5)
    dtype, num_heads, hkv = torch.bfloat16, 32, 8
    pools = make_pools(4096, hkv, 128, dtype)
    layer = AttentionLayerInfo(0, num_heads, hkv, 128, 128**-0.5)
    backend = make_backend(pools, num_heads, dtype)
    backend.init_graph_state(max_bs=2, max_num_tokens=64)
    key = _Bucket(64)
    static = make_batch(pools, E, [24, 340], [24, 40])
    q, k, v = (torch.randn(64, h, 128, dtype=dtype, device="cuda") for h in (num_heads, hkv, hkv))
    graph, out = _capture(backend, key, static, layer, q, k, v)
    for seq_lens, new_lens in (([9, 700], [9, 55]), ([130, 5], [60, 4]), ([24, 340], [24, 40])):
        fresh = make_batch(pools, E, seq_lens, new_lens)
        for name in ("req_pool_indices", "seq_lens", "out_cache_loc", "positions", "extend_prefix_lens",
                     "extend_seq_lens"):
            getattr(static, name).copy_(getattr(fresh, name))
        for t in (q, k, v):
            t.normal_()
        replay = dataclasses.replace(static, seq_lens_cpu=fresh.seq_lens_cpu,
                                     extend_prefix_lens_cpu=fresh.extend_prefix_lens_cpu,
                                     extend_seq_lens_cpu=fresh.extend_seq_lens_cpu)
        _replay_equals_eager(backend, key, replay, fresh, graph, out, layer, q, k, v)
    assert backend._graph_caches[key].fast_replans == 3


def test_decode_graph_replay_equals_eager():
    _capture_and_replay(D, [5, 1, 300, 77], [9, 1000, 2, 1], tokens_per_request=1, mask=False)


def test_target_verify_graph_replay_equals_eager():
    _capture_and_replay(V, [6, 40, 300], [900, 5, 64], tokens_per_request=4, mask=True)


# -- custom ops ------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows, hidden", [(1, 1000), (17, 4096)])
def test_norm_ops(rows, hidden):
    from backplane.plugins.attention_flashinfer import ops

    torch.manual_seed(4)
    x = torch.randn(rows, hidden, dtype=torch.bfloat16, device="cuda")
    residual = torch.randn_like(x)
    weight = torch.randn(hidden, dtype=torch.bfloat16, device="cuda")

    def rms(t):
        t = t.float()
        return (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()).bfloat16()

    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-6), rms(x), **TOL[torch.bfloat16])
    expected_residual = x + residual
    expected_y = rms(expected_residual)
    y, residual_out = ops.fused_add_rms_norm(x.clone(), residual.clone(), weight, 1e-6)
    torch.testing.assert_close(residual_out, expected_residual, **TOL[torch.bfloat16])
    torch.testing.assert_close(y, expected_y, **TOL[torch.bfloat16])


@pytest.mark.parametrize("shape", [(1, 2 * 1000), (17, 3, 2 * 512)])
def test_activation_ops(shape):
    from backplane.plugins.attention_flashinfer import ops

    torch.manual_seed(5)
    x = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    gate, up = x.float().chunk(2, dim=-1)
    expected = {
        "silu": gate * torch.sigmoid(gate) * up,
        "none": 0.5 * gate * (1 + torch.erf(gate / math.sqrt(2))) * up,
        "tanh": 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3))) * up,
    }
    torch.testing.assert_close(ops.silu_and_mul(x).float(), expected["silu"], **TOL[torch.bfloat16])
    for approximate in ("none", "tanh"):
        got = ops.gelu_and_mul(x, approximate).float()
        torch.testing.assert_close(got, expected[approximate], **TOL[torch.bfloat16])


def _rope_reference(x, cos, sin, is_neox):
    """x: [T, H, D]; cos, sin: [T, rotary_dim // 2] -> rotated x (first rotary_dim dims)."""
    rotary_dim = cos.shape[-1] * 2
    rot, rest = x[..., :rotary_dim].float(), x[..., rotary_dim:]
    cos, sin = cos[:, None], sin[:, None]
    if is_neox:
        x1, x2 = rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2 :]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).flatten(-2)
    return torch.cat((out.to(x.dtype), rest), -1)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("dtype, rotary_dim", [(torch.bfloat16, 128), (torch.bfloat16, 64), (torch.float16, 128)])
def test_rotary_embedding(is_neox, dtype, rotary_dim):
    from backplane.plugins.attention_flashinfer import ops

    torch.manual_seed(6)
    max_pos, tokens = 4099, 17
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    cache = torch.cat((freqs.cos(), freqs.sin()), -1).cuda()  # [max_pos, rotary_dim]
    positions = torch.randint(0, max_pos, (tokens,), device="cuda")
    q = torch.randn(tokens, 8, 128, dtype=dtype, device="cuda")
    k = torch.randn(tokens, 2, 128, dtype=dtype, device="cuda")
    q_got, k_got = ops.rotary_embedding(positions, q, k, cache, is_neox)
    cos, sin = cache[positions].chunk(2, dim=-1)
    torch.testing.assert_close(q_got, _rope_reference(q, cos, sin, is_neox), **TOL[dtype])
    torch.testing.assert_close(k_got, _rope_reference(k, cos, sin, is_neox), **TOL[dtype])
