"""The "triton" attention kernels on CUDA in bfloat16 against a plain-torch reference, and decode /
verify replayed from real CUDA graphs against eager runs. Run with `pytest -m gpu tests/gpu`."""

from __future__ import annotations


import pytest
import torch

pytest.importorskip("triton")

from backplane.contracts.attention import AttentionBackendContext, AttentionLayerInfo  # noqa: E402
import dataclasses  # noqa: E402

from backplane.contracts.batch import ForwardBatch, ForwardMode  # noqa: E402
from backplane.contracts.memory import ReqToTokenPool, TokenToKVPool  # noqa: E402
from backplane.plugins.attention_triton.backend import TritonAttnBackend  # noqa: E402
from backplane.plugins.attention_triton.configs import choose_num_kv_splits  # noqa: E402
from backplane.plugins.attention_triton import decode_kernels  # noqa: E402
from backplane.plugins.attention_triton.decode_kernels import decode_attention  # noqa: E402
from backplane.plugins.attention_triton.extend_kernels import extend_attention  # noqa: E402

from helpers_gpu import compiled_triton_marks  # noqa: E402

pytestmark = compiled_triton_marks(decode_kernels._decode_split_kernel, "pytest -m gpu tests/gpu")
BF16 = torch.bfloat16
ATOL = RTOL = 2e-2


def reference(q, keys, values, q_pos, scaling, softcap=0.0, window=0, mask=None):
    """Plain attention of one request. q: [n, H, D]; keys/values: [S, Hkv, D]; q_pos: [n]; mask: [n, S] or causal."""
    group = q.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, 1)
    v = values.float().repeat_interleave(group, 1)
    scores = torch.einsum("nhd,shd->hns", q.float(), k) * scaling
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    key_pos = torch.arange(keys.shape[0], device=q.device)
    visible = mask.clone() if mask is not None else key_pos[None, :] <= q_pos[:, None]
    if window > 0:
        visible &= key_pos[None, :] > q_pos[:, None] - window
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1).nan_to_num(0.0)
    return torch.einsum("hns,shd->nhd", probs, v)


def tree_mask(prefix_len, new_len, gen):
    """[new_len, prefix_len + new_len]: random prefix columns; each new token sees its tree ancestors and itself."""
    prefix = torch.rand(new_len, prefix_len, generator=gen) < 0.8
    tree = torch.eye(new_len, dtype=torch.bool)
    for i in range(1, new_len):
        tree[i] |= tree[int(torch.randint(0, i, (1,), generator=gen))]
    return torch.cat([prefix, tree], 1)


def make_pool(seq_lens, num_kv_heads, head_dim, gen):
    """Random bf16 K/V in a shuffled pool (slot 0 unused) and req_to_token rows in random order."""
    total, bs = sum(seq_lens), len(seq_lens)
    num_slots = total + 13
    shape = (num_slots + 1, num_kv_heads, head_dim)
    k_buffer = torch.randn(shape, generator=gen).to(BF16).cuda()
    v_buffer = torch.randn(shape, generator=gen).to(BF16).cuda()
    slots = torch.randperm(num_slots, generator=gen)[:total] + 1
    req_to_token = torch.zeros((bs + 3, max(seq_lens) + 8), dtype=torch.int32)
    rows = torch.randperm(bs + 3, generator=gen)[:bs]
    start = 0
    for b, n in enumerate(seq_lens):
        req_to_token[rows[b], :n] = slots[start : start + n].int()
        start += n
    return k_buffer, v_buffer, req_to_token.cuda(), rows.cuda()


def gather(k_buffer, v_buffer, req_to_token, row, n):
    slots = req_to_token[row, :n].long()
    return k_buffer[slots], v_buffer[slots]


DECODE = [
    # seq_lens (or batch size for random lengths up to 1000), heads, kv_heads, head_dim, splits, softcap, window
    ([1], 8, 8, 64, None, 0.0, 0),
    ([1000], 32, 8, 128, None, 0.0, 0),
    ([1, 7, 129], 32, 4, 128, 16, 0.0, 0),
    ([1000, 7, 129], 16, 2, 64, 1, 0.0, 0),
    (17, 32, 8, 128, None, 0.0, 0),
    (17, 8, 1, 64, 8, 30.0, 0),
    (17, 8, 2, 128, None, 0.0, 100),
    ([129, 1000, 3], 8, 2, 96, None, 0.0, 0),
    ([129, 1000, 3], 8, 1, 256, 4, 20.0, 64),
]


@pytest.mark.parametrize("merge", ["separate", "in-kernel"])
@pytest.mark.parametrize("lens,heads,kv_heads,head_dim,splits,softcap,window", DECODE)
def test_decode_bf16(lens, heads, kv_heads, head_dim, splits, softcap, window, merge):
    """merge="in-kernel" passes merge counters: with at most FUSED_MERGE_MAX_SPLITS splits the
    last slice of each group merges (atomics across programs), and the counters end at zero."""
    gen = torch.Generator().manual_seed(heads * head_dim + (lens if isinstance(lens, int) else len(lens)))
    seq_lens = torch.randint(1, 1001, (lens,), generator=gen).tolist() if isinstance(lens, int) else lens
    k_buf, v_buf, r2t, rows = make_pool(seq_lens, kv_heads, head_dim, gen)
    q = torch.randn((len(seq_lens), heads, head_dim), generator=gen).to(BF16).cuda()
    sl = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    splits = splits or choose_num_kv_splits(len(seq_lens), kv_heads, max(seq_lens), q.device, 64)
    scaling = 1.0 if softcap else head_dim**-0.5
    counters = torch.zeros(len(seq_lens) * kv_heads, dtype=torch.int32, device="cuda") if merge == "in-kernel" else None
    for _ in range(2 if counters is not None else 1):  # a second launch on the re-armed counters
        o = decode_attention(q, k_buf, v_buf, torch.empty_like(q), r2t, rows, sl, scaling, splits,
                             softcap=softcap, window=window, merge_counters=counters)
    if counters is not None:
        assert not bool(counters.any()), "a merge counter was left armed"
    for b, n in enumerate(seq_lens):
        keys, values = gather(k_buf, v_buf, r2t, rows[b], n)
        ref = reference(q[b : b + 1], keys, values, sl[b : b + 1] - 1, scaling, softcap, window)
        torch.testing.assert_close(o[b : b + 1].float(), ref, atol=ATOL, rtol=RTOL)


EXTEND = [
    # prefix_lens, new_lens, heads, kv_heads, head_dim, softcap, window, custom mask
    ([0], [1], 8, 8, 64, 0.0, 0, False),
    ([0], [1000], 32, 8, 128, 0.0, 0, False),
    ([0, 7, 129], [129, 1, 1000], 32, 4, 128, 0.0, 0, False),
    ([1000, 0, 5], [7, 129, 64], 16, 2, 64, 30.0, 0, False),
    ([300, 0, 5], [200, 129, 64], 16, 16, 128, 0.0, 77, False),
    ([129, 1000, 3], [8, 4, 16], 32, 8, 128, 0.0, 0, True),
    ([17 * i for i in range(17)], [1 + 7 * (i % 5) for i in range(17)], 8, 1, 64, 0.0, 0, False),
    ([40, 0], [129, 70], 8, 2, 96, 0.0, 0, False),
    ([40, 0], [129, 70], 8, 2, 256, 10.0, 50, False),
]


@pytest.mark.parametrize("prefix_lens,new_lens,heads,kv_heads,head_dim,softcap,window,masked", EXTEND)
def test_extend_bf16(prefix_lens, new_lens, heads, kv_heads, head_dim, softcap, window, masked):
    gen = torch.Generator().manual_seed(sum(prefix_lens) + sum(new_lens) + head_dim)
    seq_lens = [p + n for p, n in zip(prefix_lens, new_lens)]
    k_buf, v_buf, r2t, rows = make_pool(seq_lens, kv_heads, head_dim, gen)
    q = torch.randn((sum(new_lens), heads, head_dim), generator=gen).to(BF16).cuda()
    scaling = 1.0 if softcap else head_dim**-0.5
    k_new, v_new, masks, refs, start = [], [], [], [], 0
    for b, (p, n) in enumerate(zip(prefix_lens, new_lens)):
        keys, values = gather(k_buf, v_buf, r2t, rows[b], p + n)
        k_new.append(keys[p:])
        v_new.append(values[p:])
        mask = tree_mask(p, n, gen).cuda() if masked else None
        masks.append(mask)
        q_pos = torch.arange(p, p + n, device="cuda")
        refs.append(reference(q[start : start + n], keys, values, q_pos, scaling, softcap, window, mask))
        start += n
    indptr = torch.tensor([0, *torch.tensor(new_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    mask_sizes = torch.tensor([0] + [n * (p + n) for p, n in zip(prefix_lens, new_lens)])
    o = extend_attention(
        q, torch.cat(k_new), torch.cat(v_new), torch.empty_like(q), k_buf, v_buf, r2t, rows, indptr,
        torch.tensor(prefix_lens, dtype=torch.int32, device="cuda"), max(new_lens), scaling, softcap=softcap,
        window=window, custom_mask=torch.cat([m.flatten() for m in masks]) if masked else None,
        mask_indptr=mask_sizes.cumsum(0).cuda() if masked else None,
    )
    torch.testing.assert_close(o.float(), torch.cat(refs), atol=ATOL, rtol=RTOL)


# -- graphs: capture once, replay with new lengths, compare with eager ------------------------------

LAYER = AttentionLayerInfo(0, 32, 8, 128, scaling=128**-0.5)
MAX_CTX = 2048


def make_backend(gen, num_rows=64, options=None):
    """A backend over a pool whose rows are filled to MAX_CTX - 8 positions with shuffled slots."""
    req_pool = ReqToTokenPool(num_rows, MAX_CTX, "cuda")
    kv_pool = TokenToKVPool(num_rows * MAX_CTX, 1, 8, 128, BF16, "cuda")
    ctx = AttentionBackendContext(32, 8, 128, 1, BF16, torch.device("cuda"), req_pool, kv_pool, MAX_CTX,
                                  options=options)
    filled = MAX_CTX - 8
    rows = [req_pool.alloc() for _ in range(num_rows)]
    slots = kv_pool.alloc(num_rows * filled)[torch.randperm(num_rows * filled, generator=gen)].cuda()
    req_pool.req_to_token[rows] = torch.nn.functional.pad(slots.view(num_rows, filled).int(), (0, 8))
    cuda_gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    shape = (slots.numel(), 8, 128)
    kv_pool.set_kv_buffer(0, slots, torch.randn(shape, generator=cuda_gen, device="cuda").to(BF16),
                          torch.randn(shape, generator=cuda_gen, device="cuda").to(BF16))
    return TritonAttnBackend(ctx), rows


def padded_batch(backend, mode, rows, seq_lens, per_request, pad_to, gen, masked):
    """Real requests end at seq_lens (their last per_request tokens are new); padding as the graph runner does."""
    pad = pad_to - len(rows)
    r2t = backend.req_to_token
    loc = [r2t[row, n - per_request : n].long() for row, n in zip(rows, seq_lens)]
    loc.append(torch.zeros(pad * per_request, dtype=torch.int64, device="cuda"))
    seq = torch.tensor(seq_lens + [1] * pad, dtype=torch.int32, device="cuda")
    mask = None
    if masked:
        mask = torch.cat([tree_mask(n - per_request, per_request, gen).flatten() for n in seq_lens]).cuda()
    tokens = pad_to * per_request
    return ForwardBatch(
        forward_mode=mode, batch_size=pad_to, input_ids=torch.zeros(tokens, dtype=torch.int64, device="cuda"),
        positions=torch.zeros(tokens, dtype=torch.int64, device="cuda"),
        req_pool_indices=torch.tensor(rows + [rows[0]] * pad, device="cuda"), seq_lens=seq,
        seq_lens_cpu=seq.cpu(), out_cache_loc=torch.cat(loc), req_to_token_pool=backend.ctx.req_to_token_pool,
        token_to_kv_pool=backend.kv_pool, custom_mask=mask,
    )


def unpadded(batch, real, per_request):
    n = real * per_request
    return dataclasses.replace(
        batch, batch_size=real, input_ids=batch.input_ids[:n], positions=batch.positions[:n],
        req_pool_indices=batch.req_pool_indices[:real], seq_lens=batch.seq_lens[:real],
        seq_lens_cpu=batch.seq_lens_cpu[:real], out_cache_loc=batch.out_cache_loc[:n],
    )


@pytest.mark.parametrize("mode,per_request,masked,graph_bs,real", [
    (ForwardMode.DECODE, 1, False, 8, 5),
    (ForwardMode.DECODE, 1, False, 1, 1),
    (ForwardMode.DECODE, 1, False, 64, 61),
    (ForwardMode.TARGET_VERIFY, 4, True, 8, 6),
    (ForwardMode.TARGET_VERIFY, 3, False, 4, 4),
    (ForwardMode.TARGET_VERIFY, 8, True, 8, 5),
])
@pytest.mark.parametrize("verify_kernel", ["extend", "split"])
def test_cuda_graph_replay_matches_eager(mode, per_request, masked, graph_bs, real, verify_kernel):
    if verify_kernel == "split" and mode is not ForwardMode.TARGET_VERIFY:
        pytest.skip("the verify kernel option only affects TARGET_VERIFY")
    from backplane.plugins.attention_triton.options import TritonAttentionOptions

    gen = torch.Generator().manual_seed(graph_bs * 10 + per_request)
    backend, rows = make_backend(gen, options=TritonAttentionOptions(verify_kernel=verify_kernel))
    backend.init_graph_state(max_bs=64, max_num_tokens=64 * 4)
    rows = rows[:real]

    def draw():
        seq_lens = torch.randint(per_request, MAX_CTX - 8, (real,), generator=gen).tolist()
        batch = padded_batch(backend, mode, rows, seq_lens, per_request, graph_bs, gen, masked)
        n = graph_bs * per_request
        qkv = [torch.randn((n, h, 128), generator=gen).to(BF16).cuda() for h in (32, 8, 8)]
        return batch, qkv

    static_batch, static_qkv = draw()
    key = (mode, graph_bs, per_request)
    backend.init_metadata_for_capture(key, static_batch)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward(*static_qkv, LAYER, static_batch)  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = backend.forward(*static_qkv, LAYER, static_batch)

    for _ in range(3):
        batch, qkv = draw()
        for static, fresh in zip(static_qkv, qkv):
            static.copy_(fresh)
        static_batch.out_cache_loc.copy_(batch.out_cache_loc)
        backend.init_metadata_for_replay(key, batch)
        graph.replay()
        n = real * per_request
        got = static_out[:n].clone()
        eager_batch = unpadded(batch, real, per_request)
        backend.init_forward_metadata(eager_batch)
        want = backend.forward(*(t[:n] for t in qkv), LAYER, eager_batch)
        torch.testing.assert_close(got.float(), want.float(), atol=ATOL, rtol=RTOL)
