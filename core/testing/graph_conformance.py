"""Graph-replay conformance: capture a backend's decode (or a DRAFT_EXTEND of the same number of
tokens in every request, as an EAGLE draft window) in CUDA graphs at several batch sizes, then
replay random padded batches over many steps and compare with torch_native. Needs CUDA; used by
`attention_conformance.make_graph_suite`.

The extend case (`check_extend_graph_replay`, any device): ragged EXTEND batches padded into
(request slots, token bucket) keys, captured in full (a CUDA graph, or `rerun_capture` off CUDA)
or run as piecewise replay runs attention (eagerly on the padded batch), against torch_native on
the real batch.

The compile case (`check_compiled_decode`, any device): decode through the core's opaque op
`torch.ops.backplane.attention` inside a `torch.compile(fullgraph=True, dynamic=True)` region, as
`--enable-torch-compile` runs it, over random batch sizes; equal to torch_native.
"""

from __future__ import annotations

import random

import torch

from backplane.contracts.attention import AttentionLayerInfo
from backplane.contracts.batch import ForwardBatch, ForwardMode
from backplane.executor.graph_runner import StaticInputs, capture_graph, pad_into, rerun_capture
from backplane.executor.graph_sizes import (GraphKey, extend_batch_sizes, extend_shape, extend_token_buckets,
                                            padded_size)
from backplane.models.base import ModelContext
from backplane.testing.attention_harness import TOLERANCE, Case, ExtendWorld, Harness

PAD_ROW_SEQ = 1


class DecodeWorld:
    """`num_reqs` requests with random cached lengths; each step runs `tokens` new tokens of a
    random subset (one: DECODE; more: a DRAFT_EXTEND without extend lengths, causal)."""

    def __init__(self, num_reqs: int, max_len: int, dtype, seed: int, device: str = "cuda"):
        case = Case("graph", "decode", tuple([max_len] * num_reqs), (1,) * num_reqs, num_heads=8, num_kv_heads=2)
        self.h = Harness(case, dtype, device, seed)
        self.rng, self.max_len = random.Random(seed), max_len
        self.cached = [self.rng.randint(1, max_len - 40) for _ in range(num_reqs)]
        self.pad_row = self.h.req_pool.alloc()  # an all-zero row: padded requests read slot 0
        self.h.req_pool.req_to_token[self.pad_row].zero_()

    def step_batch(self, bs: int, tokens: int = 1) -> ForwardBatch:
        reqs = self.rng.sample(range(len(self.cached)), bs)
        for r in reqs:  # keep every position inside the placed prefix
            if self.cached[r] + tokens >= self.max_len:
                self.cached[r] = self.rng.randint(1, self.max_len // 2)
        rows = [self.h.rows[r] for r in reqs]
        seq = [self.cached[r] + tokens for r in reqs]
        positions = [p for s in seq for p in range(s - tokens, s)]
        r2t = self.h.req_pool.req_to_token.cpu()
        locs = torch.tensor([int(r2t[row, p]) for row, s in zip(rows, seq) for p in range(s - tokens, s)])
        for r in reqs:
            self.cached[r] += tokens
        dev = self.h.device
        mode = ForwardMode.DECODE if tokens == 1 else ForwardMode.DRAFT_EXTEND
        return ForwardBatch(forward_mode=mode, batch_size=bs, input_ids=torch.zeros(bs * tokens, dtype=torch.int64, device=dev),
                            positions=torch.tensor(positions, device=dev), req_pool_indices=torch.tensor(rows, device=dev),
                            seq_lens=torch.tensor(seq, dtype=torch.int32, device=dev),
                            seq_lens_cpu=torch.tensor(seq, dtype=torch.int32), out_cache_loc=locs.to(dev),
                            req_to_token_pool=self.h.req_pool, token_to_kv_pool=self.h.kv_pool)


def check_graph_replay(spec, dtype=torch.bfloat16, sizes=(1, 2, 4, 8, 16), steps: int = 24, seed: int = 0,
                       tokens: int = 1) -> float:
    """Returns the worst |graph - torch_native| seen; raises AssertionError on a mismatch.

    tokens: new tokens per request (1: DECODE graphs; more: uniform DRAFT_EXTEND graphs)."""
    from backplane.attention.torch_native import TorchNativeAttnBackend

    world = DecodeWorld(num_reqs=max(sizes) + 3, max_len=300, dtype=dtype, seed=seed)
    layer: AttentionLayerInfo = world.h.layer()
    backend = spec.factory(world.h.context())
    reference = TorchNativeAttnBackend(world.h.context())
    max_bs, T = max(sizes), tokens
    mode = ForwardMode.DECODE if T == 1 else ForwardMode.DRAFT_EXTEND
    fill = max(spec.seq_len_fill_value, T)  # a padded request holds its T tokens
    backend.init_graph_state(max_bs, max_bs * T)
    static = StaticInputs.allocate(max_bs, max_bs * T, "cuda")
    q = torch.zeros(max_bs * T, layer.num_heads, layer.head_dim, dtype=dtype, device="cuda")
    kv = torch.zeros(2, max_bs * T, layer.num_kv_heads, layer.head_dim, dtype=dtype, device="cuda")
    graphs, outs = {}, {}
    for bs in sorted(sizes, reverse=True):
        key = GraphKey(mode, bs, T)
        batch = pad_into(static, world.step_batch(1, T), key, world.pad_row, fill)
        backend.init_metadata_for_capture(key, batch)
        n = bs * T
        graphs[key], outs[key] = capture_graph(lambda n=n, batch=batch: backend.forward(
            q[:n], kv[0, :n], kv[1, :n], layer, batch))
    worst, rng = 0.0, random.Random(seed)
    for _ in range(steps):
        real = world.step_batch(rng.randint(1, max_bs), T)
        key = GraphKey(mode, padded_size(real.batch_size, sorted(sizes)), T)
        n = real.num_tokens
        new_q, new_k, new_v = (world.h.randn(n, layer.num_heads, layer.head_dim),
                               world.h.randn(n, layer.num_kv_heads, layer.head_dim),
                               world.h.randn(n, layer.num_kv_heads, layer.head_dim))
        padded = pad_into(static, real, key, world.pad_row, fill)
        q[:n].copy_(new_q)
        kv[0, :n].copy_(new_k)
        kv[1, :n].copy_(new_v)
        backend.init_metadata_for_replay(key, padded)
        graphs[key].replay()
        got = outs[key][:n].float().clone()
        reference.init_forward_metadata(real)
        want = reference.forward(new_q, new_k, new_v, layer, real).float()
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=lambda m, real=real, key=key: (
            f"{mode.value} graph replay at batch {real.batch_size} (padded to {key.batch_size}): {m}"))
        worst = max(worst, float((got - want).abs().max()))
    return worst


class _OpaqueLayer:
    """What torch.ops.backplane.attention looks up by handle: `ctx.attn_backend` and `info`."""

    def __init__(self, backend, info: AttentionLayerInfo):
        self.ctx, self.info = ModelContext(attn_backend=backend), info


def check_compiled_decode(spec, dtype=torch.bfloat16, device: str = "cuda", steps: int = 8, seed: int = 0,
                          max_bs: int = 9) -> float:
    """Decode through the opaque attention op in one compiled region (fullgraph: a graph break
    fails), over `steps` random batches of 1..max_bs requests, against torch_native eagerly.
    Returns the worst |compiled - torch_native|; raises AssertionError on a mismatch."""
    from backplane.attention.torch_native import TorchNativeAttnBackend
    from backplane.ops import opaque

    world = DecodeWorld(num_reqs=max_bs + 3, max_len=200, dtype=dtype, seed=seed, device=device)
    layer = world.h.layer()
    backend, reference = spec.factory(world.h.context()), TorchNativeAttnBackend(world.h.context())
    holder = _OpaqueLayer(backend, layer)  # kept alive: the op's handle table holds weak references
    handle = opaque.register_layer(holder)

    def body(q, k, v):
        # q: [T, H, D]; the scaling around the op is what Inductor fuses; the op stays one call.
        out = torch.empty_like(q)
        torch.ops.backplane.attention(q * 1.0, k, v, out, handle)
        return out * 1.0

    compiled = torch.compile(body, fullgraph=True, dynamic=True)
    worst, rng = 0.0, random.Random(seed)
    for _ in range(steps):
        real = world.step_batch(rng.randint(1, max_bs))
        n = real.num_tokens
        q, k, v = (world.h.randn(n, layer.num_heads, layer.head_dim), world.h.randn(n, layer.num_kv_heads, layer.head_dim),
                   world.h.randn(n, layer.num_kv_heads, layer.head_dim))
        backend.init_forward_metadata(real)  # planning stays outside the compiled region
        with holder.ctx.bind(holder.ctx.context_for(real)):  # what the op reads the batch from
            got = compiled(q, k, v).float()
        reference.init_forward_metadata(real)
        want = reference.forward(q, k, v, layer, real).float()
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=lambda m, real=real: (
            f"compiled decode through torch.ops.backplane.attention at batch {real.batch_size}: {m}"))
        worst = max(worst, float((got - want).abs().max()))
    del holder
    return worst


def extend_graph_kind(spec) -> str | None:
    """How the backend of `spec` declares EXTEND graphs: "full", "piecewise", or None."""
    if "extend" in spec.graph_modes:
        return "full"
    if "extend" in getattr(spec, "piecewise_graph_modes", ()):
        return "piecewise"
    return None


def extend_keys(buckets: list[int], sizes: list[int]) -> list[GraphKey]:
    """The runner's extend keys: every (request slots, token bucket) with slots <= bucket, largest first."""
    return [GraphKey(ForwardMode.EXTEND, bs, 0, token_bucket=t) for t in reversed(buckets)
            for bs in reversed(sizes) if bs <= t]


def shape_for(key: GraphKey, buckets: list[int], sizes: list[int], rng: random.Random) -> tuple[int, int]:
    """A random (requests, new tokens) that `extend_shape` pads into `key`: a quarter of the time
    the exact fit (no padded request), else fewer tokens than the bucket and room for the padded one."""
    below = max([t for t in buckets if t < key.token_bucket], default=0)
    smaller = max([s for s in sizes if s < key.batch_size], default=0)
    for _ in range(500):
        exact = rng.random() < 0.25
        n = key.token_bucket if exact else rng.randint(below + 1, key.token_bucket)
        bs = key.batch_size if exact else rng.randint(max(smaller, 1), key.batch_size)
        if bs <= n and extend_shape(n, bs, buckets, sizes) == (key.batch_size, key.token_bucket):
            return bs, n
    raise AssertionError(f"no batch pads into {key} with buckets {buckets} and slots {sizes}")


def capture_extend_batch(static: StaticInputs, world, key: GraphKey) -> ForwardBatch:
    """What the graph runner captures an extend key with: key.batch_size requests on the padding
    row, no prefix, new tokens [T - (B - 1), 1, ..., 1], K/V to the dump slot; the padded view."""
    bs, n = key.batch_size, key.token_bucket
    lens = [n - (bs - 1)] + [1] * (bs - 1)
    dev = world.h.device
    like = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=bs, input_ids=torch.zeros(n, dtype=torch.int64, device=dev),
                        positions=torch.cat([torch.arange(k) for k in lens]).to(dev),
                        req_pool_indices=torch.full((bs,), world.pad_row, dtype=torch.int64, device=dev),
                        seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
                        seq_lens_cpu=torch.tensor(lens, dtype=torch.int32), out_cache_loc=torch.zeros(n, dtype=torch.int64, device=dev),
                        req_to_token_pool=world.h.req_pool, token_to_kv_pool=world.h.kv_pool)
    like.set_extend_lens([0] * bs, lens)
    return pad_into(static, like, key, world.pad_row, 1)


def check_extend_graph_replay(spec, dtype=torch.bfloat16, device: str = "cuda", max_tokens: int = 256,
                              max_requests: int = 8, replays_per_key: int = 3, seed: int = 0, window: int = 0,
                              softcap: float = 0.0, kind: str | None = None, options=None,
                              num_heads: int = 8) -> float:
    """EXTEND graphs of the backend of `spec` against torch_native on the real batches.

    The keys are the runner's ladders (`extend_token_buckets(max_tokens)` x
    `extend_batch_sizes(max_requests)`); each key is captured once, then replayed
    `replays_per_key` times over random ragged batches padded into it with `pad_into` (several
    requests, different new-token counts, some over cached prefixes; `window` / `softcap` on the
    layer). kind "full" (default when the spec declares extend in graph_modes): init_graph_state,
    init_metadata_for_capture, then per replay init_metadata_for_replay and the graph's replay;
    on CUDA a real graph, elsewhere `rerun_capture` (the captured call re-run, so host values
    read at capture stay stale as in a graph). kind "piecewise": per replay the backend's
    init_forward_metadata and forward on the padded batch, as piecewise replay runs attention.
    Checks every real request's output rows and the pool: real K/V written at their slots, padded
    tokens only into the dump slot 0. Returns the worst |graph - torch_native|."""
    from backplane.attention.torch_native import TorchNativeAttnBackend

    kind = kind or extend_graph_kind(spec)
    if kind not in ("full", "piecewise"):
        raise ValueError(f"extend graph conformance: expected kind 'full' or 'piecewise', got {kind!r}")
    buckets, sizes = extend_token_buckets(max_tokens), extend_batch_sizes(max_requests)
    world = ExtendWorld(num_reqs=max(sizes) + 3, max_len=max_tokens + 48, dtype=dtype, seed=seed, device=device,
                        window=window, softcap=softcap, num_heads=num_heads)
    h, layer = world.h, world.h.layer()
    backend = spec.factory(h.context(options))
    reference = TorchNativeAttnBackend(h.context())
    static = StaticInputs.allocate(max(sizes), max_tokens, device)
    qkv = (torch.zeros(max_tokens, layer.num_heads, layer.head_dim, dtype=dtype, device=device),
           torch.zeros(max_tokens, layer.num_kv_heads, layer.head_dim, dtype=dtype, device=device),
           torch.zeros(max_tokens, layer.num_kv_heads, layer.head_dim, dtype=dtype, device=device))
    keys = extend_keys(buckets, sizes)
    graphs, outs = (_capture_extend(backend, static, world, keys, qkv, layer, max(sizes), max_tokens)
                    if kind == "full" else ({}, {}))
    worst, rng = 0.0, random.Random(seed)
    for key in keys:
        for _ in range(replays_per_key):
            bs, n = shape_for(key, buckets, sizes, rng)
            real = world.batch(world.split(n, bs))
            fresh = [h.randn(n, *t.shape[1:]) for t in qkv]
            for buf, new in zip(qkv, fresh):  # padded rows: garbage that must not reach a real row
                buf[:n].copy_(new)
                buf[n:key.token_bucket].copy_(10 * h.randn(key.token_bucket - n, *buf.shape[1:]))
            before = [b.clone() for b in h.kv_pool.get_kv_buffer(0)]
            padded = pad_into(static, real, key, world.pad_row, 1)
            got = _replay_extend(kind, backend, graphs, outs, key, padded, qkv, layer)[:n].float().clone()
            where = (f"{kind} extend graph {key.batch_size} requests x {key.token_bucket} tokens replaying "
                     f"{bs} requests (new {real.extend_seq_lens_cpu.tolist()}, prefix "
                     f"{real.extend_prefix_lens_cpu.tolist()}) of {n} tokens")
            _check_kv_writes(h, before, real, fresh, where)
            reference.init_forward_metadata(real)
            want = reference.forward(*fresh, layer, real).float()
            tol = TOLERANCE[dtype]
            torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=lambda m, where=where: f"{where}: {m}")
            worst = max(worst, float((got - want).abs().max()))
    return worst


def _capture_extend(backend, static, world, keys, qkv, layer, max_bs: int, max_tokens: int):
    """Capture every key (largest first): a CUDA graph on CUDA, `rerun_capture` elsewhere."""
    cuda = world.h.device.type == "cuda"
    capture = capture_graph if cuda else rerun_capture
    backend.init_graph_state(max_bs, max_tokens)
    graphs, outs = {}, {}
    for key in keys:
        batch = capture_extend_batch(static, world, key)
        backend.init_metadata_for_capture(key, batch)
        t = key.token_bucket
        graphs[key], outs[key] = capture(lambda t=t, batch=batch: backend.forward(
            qkv[0][:t], qkv[1][:t], qkv[2][:t], layer, batch))
    return graphs, outs


def _replay_extend(kind: str, backend, graphs, outs, key: GraphKey, padded: ForwardBatch, qkv, layer) -> torch.Tensor:
    t = key.token_bucket
    if kind == "piecewise":
        backend.init_forward_metadata(padded)
        return backend.forward(qkv[0][:t], qkv[1][:t], qkv[2][:t], layer, padded)
    backend.init_metadata_for_replay(key, padded)
    graphs[key].replay()
    return outs[key]


def _check_kv_writes(h, before: list[torch.Tensor], real: ForwardBatch, fresh: list[torch.Tensor], where: str) -> None:
    """The real tokens' K/V sit at their slots; no other slot but the dump slot 0 changed."""
    locs = real.out_cache_loc
    for name, buf, old, new in zip(("K", "V"), h.kv_pool.get_kv_buffer(0), before, fresh[1:]):
        want = old.clone()
        want[locs] = new.to(want.dtype)
        if not torch.equal(buf[1:], want[1:]):
            bad = (buf[1:] != want[1:]).flatten(1).any(1).nonzero().flatten() + 1
            raise AssertionError(f"{where}: {name} differs from the expected pool at slots {bad[:8].tolist()} "
                                 "(real tokens write at out_cache_loc, padded ones only into the dump slot 0)")
