"""Tree verify under a sliding window: the window goes by position, not by index in the tree.

In a TARGET_VERIFY batch of EAGLE draft trees (top-k > 1) node i of a request sits at position
num_cached + depth(i), which is not num_cached + i once the tree branches; a sliding-window layer
must window each node by that position (the cached prefix keys are at their indices). Here:
- torch_native against a brute-force per-query formula built from the trees' parents alone, and a
  check that windowing by index gives another answer for these trees (so the cases bite);
- triton (CPU: the interpreter, fp32) against torch_native, eager and through its graph metadata
  (bound at capture, refreshed for another batch of trees);
- flashinfer: the mask with the window folded in by position (`window_mask`) against the formula,
  and the backend end to end, eager and graph-bound, through the plain-torch flashinfer stand-in
  of tests/plugins/attention_flashinfer (which, like FlashInfer, windows by key index);
- GPU (marker gpu): triton and flashinfer captured in a CUDA graph, replayed over other trees,
  against torch_native.
"""

from __future__ import annotations

import importlib.util
import random
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from backplane.attention.torch_native import TorchNativeAttnBackend
from backplane.contracts.attention import AttentionBackendContext, AttentionLayerInfo
from backplane.contracts.batch import ForwardBatch
from backplane.contracts.memory import ReqToTokenPool, TokenToKVPool
from backplane.plugin.manager import load_plugins
from backplane.speculative import DraftTree, verify_mask
from backplane.speculative.verify_batch import build_verify_batch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 64  # 64: a head dim every backend serves
WINDOW = 4
# Gemma 2's pair: a sliding-window layer with a soft-cap, then a global layer.
LAYERS = [AttentionLayerInfo(0, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, sliding_window=WINDOW,
                             logit_softcap=5.0),
          AttentionLayerInfo(1, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)]
# (name, cached prefix per request, nodes per tree, tree depth limit); the second spans two query
# blocks and several prefix key blocks of the CPU kernel config (32 x 32), its shallow wide trees
# (as EAGLE's: a few steps, many branches) putting nodes of the second query block near the prefix.
CASES = [("three-trees", (9, 1, 13), 7, None), ("two-query-blocks", (70, 35), 40, 3)]
CASE_IDS = [c[0] for c in CASES]
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run is for CPU machines; "
                              "the gpu tests below cover CUDA")


def random_parents(num_reqs: int, num_nodes: int, rng: random.Random, max_depth: int | None = None) -> list[list[int]]:
    """A draft tree per request: node 0 the root, every other node's parent a random earlier node
    (of depth below `max_depth`, when given)."""
    trees = []
    for _ in range(num_reqs):
        parents, depth = [-1], [0]
        for _ in range(1, num_nodes):
            parents.append(rng.choice([j for j, d in enumerate(depth) if max_depth is None or d < max_depth]))
            depth.append(depth[parents[-1]] + 1)
        trees.append(parents)
    return trees


def expected_visible(prefix: int, parents: list[int], window: int, by_index: bool = False) -> torch.Tensor:
    """[n, prefix + n] bool from the parents alone: node i at prefix + depth(i) (prefix + i when
    `by_index`, the bug) sees the prefix and its ancestors and itself, those within `window` positions."""
    n = len(parents)
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    node_pos = [prefix + (i if by_index else depth[i]) for i in range(n)]
    key_pos = list(range(prefix)) + node_pos
    visible = torch.zeros(n, prefix + n, dtype=torch.bool)
    for i in range(n):
        visible[i, :prefix] = True
        j = i
        while j >= 0:
            visible[i, prefix + j] = True
            j = parents[j]
        if window > 0:
            visible[i] &= torch.tensor(key_pos) > node_pos[i] - window
    return visible


class TreeWorld:
    """Request rows holding a shuffled pool slot for every position, random K/V in every slot."""

    def __init__(self, num_reqs: int, max_len: int, dtype=torch.float32, device="cpu", seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.device, self.dtype, self.max_len = torch.device(device), dtype, max_len
        num_slots = num_reqs * max_len
        self.req_pool = ReqToTokenPool(num_reqs + 1, max_len, device)
        self.kv_pool = TokenToKVPool(num_slots, len(LAYERS), NUM_KV_HEADS, HEAD_DIM, dtype, device)
        for layer in range(len(LAYERS)):
            for buf in self.kv_pool.get_kv_buffer(layer):
                buf.copy_(torch.randn(buf.shape, generator=gen).to(device, dtype))
        self.rows = [self.req_pool.alloc() for _ in range(num_reqs)]
        slots = (torch.randperm(num_slots, generator=gen) + 1).view(num_reqs, max_len)  # never slot 0
        for row, row_slots in zip(self.rows, slots):
            self.req_pool.req_to_token[row] = row_slots.to(device, torch.int32)
        self.gen = gen

    def verify(self, prefixes, parents) -> ForwardBatch:
        """The TARGET_VERIFY batch of these trees over these cached prefixes, built as the engine does."""
        tree = DraftTree(torch.zeros(len(parents), len(parents[0]), dtype=torch.int64), torch.tensor(parents))
        n = tree.num_nodes
        mask, indptr = verify_mask(tree, list(prefixes))
        positions = (torch.tensor(prefixes)[:, None] + tree.depths).view(-1)
        r2t = self.req_pool.req_to_token.cpu()
        loc = torch.cat([r2t[row, p:p + n].long() for row, p in zip(self.rows, prefixes)])
        reqs = [SimpleNamespace(num_cached=p, row=row) for row, p in zip(self.rows, prefixes)]
        return build_verify_batch(reqs, [0] * loc.numel(), positions.tolist(), loc, n, mask, indptr,
                                  self.req_pool, self.kv_pool)

    def context(self, options=None) -> AttentionBackendContext:
        return AttentionBackendContext(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, len(LAYERS), self.dtype, self.device,
                                       self.req_pool, self.kv_pool, max_context_len=self.max_len, options=options)

    def qkv(self, num_tokens: int):
        """Fresh random q, k, v of one layer: [T, H, D], [T, Hk, D], [T, Hk, D]."""
        shapes = ((num_tokens, NUM_HEADS, HEAD_DIM), (num_tokens, NUM_KV_HEADS, HEAD_DIM),
                  (num_tokens, NUM_KV_HEADS, HEAD_DIM))
        return [torch.randn(s, generator=self.gen).to(self.device, self.dtype) for s in shapes]


def brute_force(world: TreeWorld, prefixes, parents, q, layer: AttentionLayerInfo, by_index=False) -> torch.Tensor:
    """Per query and head in float64, over the keys `expected_visible` allows, read from the pool."""
    k_buf, v_buf = (b.cpu().double() for b in world.kv_pool.get_kv_buffer(layer.layer_id))
    r2t = world.req_pool.req_to_token.cpu()
    group = layer.num_heads // layer.num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    token = 0
    for row, prefix, tree in zip(world.rows, prefixes, parents):
        slots = r2t[row, : prefix + len(tree)].long()
        visible = expected_visible(prefix, tree, layer.sliding_window, by_index)
        for i in range(len(tree)):
            keys, values = k_buf[slots[visible[i]]], v_buf[slots[visible[i]]]  # [m, Hk, D]
            for h in range(layer.num_heads):
                scores = keys[:, h // group] @ q[token, h].cpu().double() * layer.scaling
                if layer.logit_softcap > 0:
                    scores = layer.logit_softcap * torch.tanh(scores / layer.logit_softcap)
                out[token, h] = torch.softmax(scores, 0) @ values[:, h // group]
            token += 1
    return out


def run_layers(backend, batch: ForwardBatch, qkvs, plan=True) -> list[torch.Tensor]:
    if plan:
        backend.init_forward_metadata(batch)
    return [backend.forward(q, k, v, layer, batch) for layer, (q, k, v) in zip(LAYERS, qkvs)]


def reference(world: TreeWorld, batch: ForwardBatch, qkvs) -> list[torch.Tensor]:
    return run_layers(TorchNativeAttnBackend(world.context()), batch, qkvs)


def spec(name: str):
    found = load_plugins().registry.specs("attention")[name]
    reason = found.available()
    if reason:
        pytest.skip(f"{name}: {reason}")
    return found


# -- torch_native --------------------------------------------------------------------------------


@pytest.mark.parametrize("name, prefixes, num_nodes, max_depth", CASES, ids=CASE_IDS)
def test_torch_native_windows_tree_nodes_by_position(name, prefixes, num_nodes, max_depth):
    world = TreeWorld(len(prefixes), max(prefixes) + num_nodes + 3, seed=1)
    parents = random_parents(len(prefixes), num_nodes, random.Random(name), max_depth)
    batch = world.verify(prefixes, parents)
    qkvs = [world.qkv(batch.num_tokens) for _ in LAYERS]
    outs = reference(world, batch, qkvs)
    for layer, out, (q, _, _) in zip(LAYERS, outs, qkvs):
        expected = brute_force(world, prefixes, parents, q, layer)
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5, msg=lambda m, i=layer.layer_id: f"layer {i}: {m}")
    by_index = brute_force(world, prefixes, parents, qkvs[0][0], LAYERS[0], by_index=True)
    assert (outs[0].double() - by_index).abs().max() > 1e-2, "these trees must tell position from index"


# -- triton (CPU: the interpreter) ---------------------------------------------------------------


@CPU_ONLY
@pytest.mark.parametrize("name, prefixes, num_nodes, max_depth", CASES, ids=CASE_IDS)
def test_triton_matches_torch_native(name, prefixes, num_nodes, max_depth):
    world = TreeWorld(len(prefixes), max(prefixes) + num_nodes + 3, seed=2)
    batch = world.verify(prefixes, random_parents(len(prefixes), num_nodes, random.Random(name), max_depth))
    qkvs = [world.qkv(batch.num_tokens) for _ in LAYERS]
    ours = run_layers(spec("triton").factory(world.context()), batch, qkvs)
    for got, want in zip(ours, reference(world, batch, qkvs)):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


@CPU_ONLY
def test_triton_graph_metadata_reads_each_replays_positions():
    """Capture binds the static positions; a replay over other trees and prefixes refreshes them."""
    world, rng = TreeWorld(3, 60, seed=3), random.Random(3)
    backend = spec("triton").factory(world.context())
    backend.init_graph_state(max_bs=4, max_num_tokens=32)
    capture = world.verify((5, 9, 2), random_parents(3, 6, rng))
    backend.init_metadata_for_capture("verify-3x6", capture)
    run_layers(backend, capture, [world.qkv(18) for _ in LAYERS], plan=False)
    for prefixes in [(30, 1, 17), (8, 40, 3)]:
        batch = world.verify(prefixes, random_parents(3, 6, rng))
        backend.init_metadata_for_replay("verify-3x6", batch)
        meta = backend.forward_metadata
        assert meta.positions.data_ptr() == backend.graph_buffers.positions.data_ptr()
        qkvs = [world.qkv(18) for _ in LAYERS]
        ours = run_layers(backend, batch, qkvs, plan=False)
        for got, want in zip(ours, reference(world, batch, qkvs)):
            torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


# -- flashinfer: the folded mask, and the backend through the plain-torch stand-in ----------------


def test_flashinfer_window_mask_folds_the_window_by_position():
    from backplane.plugins.attention_flashinfer.geometry import ForwardGeometry, LayerConfig, window_mask

    world, rng = TreeWorld(4, 40, seed=4), random.Random(4)
    prefixes, parents = (11, 0, 3, 25), random_parents(4, 9, rng)
    batch = world.verify(prefixes, parents)
    geo = ForwardGeometry(batch)
    for window in (1, WINDOW, 30):
        folded = window_mask(batch, geo.custom_mask, geo.query_lens_cpu, window)
        expected = torch.cat([expected_visible(p, t, window).flatten() for p, t in zip(prefixes, parents)])
        assert torch.equal(folded, expected), f"window {window}"
    assert geo.mask_for(LayerConfig(-1, 0.0, 1.0)) is geo.custom_mask  # a global layer: the batch's mask
    assert torch.equal(geo.mask_for(LayerConfig(WINDOW - 1, 0.0, 1.0)),
                       window_mask(batch, geo.custom_mask, geo.query_lens_cpu, WINDOW))


@pytest.fixture
def flashinfer_stand_in(monkeypatch):
    """tests/plugins/attention_flashinfer's plain-torch `flashinfer` (FlashInfer 0.7.2's wrapper API;
    its window counts keys by index, as FlashInfer's does), installed as the module."""
    path = Path(__file__).parents[1] / "plugins" / "attention_flashinfer" / "test_flashinfer_cpu.py"
    loader = importlib.util.spec_from_file_location("flashinfer_stand_in", path)
    fakes = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(fakes)
    module = types.ModuleType("flashinfer")
    module.BatchDecodeWithPagedKVCacheWrapper = fakes.FakeDecode
    module.BatchPrefillWithPagedKVCacheWrapper = fakes.FakePagedPrefill
    module.BatchPrefillWithRaggedKVCacheWrapper = fakes.FakeRaggedPrefill
    module.merge_state = fakes._fake_merge_state
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return module


def _flashinfer(world: TreeWorld):
    from backplane.plugins.attention_flashinfer.backend import FlashInferAttnBackend
    from backplane.plugins.attention_flashinfer.options import FlashInferOptions

    return FlashInferAttnBackend(world.context(FlashInferOptions(workspace_size_mb=16)))


@pytest.mark.parametrize("name, prefixes, num_nodes, max_depth", CASES, ids=CASE_IDS)
def test_flashinfer_stand_in_matches_torch_native(flashinfer_stand_in, name, prefixes, num_nodes, max_depth):
    world = TreeWorld(len(prefixes), max(prefixes) + num_nodes + 3, seed=5)
    batch = world.verify(prefixes, random_parents(len(prefixes), num_nodes, random.Random(name), max_depth))
    backend = _flashinfer(world)
    for _ in range(2):  # the first pass learns the layer configs, the second plans them up front
        qkvs = [world.qkv(batch.num_tokens) for _ in LAYERS]
        for got, want in zip(run_layers(backend, batch, qkvs), reference(world, batch, qkvs)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_flashinfer_stand_in_graph_replays_fold_each_batch(flashinfer_stand_in):
    """Graph-bound: the sliding layer's masked wrapper has its own mask buffer (the global one's mask
    differs), planned without a window; replays over other trees equal torch_native."""
    from backplane.plugins.attention_flashinfer.geometry import MASKED, LayerConfig

    world, rng = TreeWorld(3, 60, seed=6), random.Random(6)
    backend = _flashinfer(world)
    backend.init_graph_state(max_bs=4, max_num_tokens=32)
    capture = world.verify((5, 9, 2), random_parents(3, 6, rng))
    backend.init_metadata_for_capture("verify-3x6", capture)
    run_layers(backend, capture, [world.qkv(18) for _ in LAYERS], plan=False)  # warm-up: learns the configs
    for prefixes in [(30, 1, 17), (8, 40, 3)]:
        batch = world.verify(prefixes, random_parents(3, 6, rng))
        backend.init_metadata_for_replay("verify-3x6", batch)
        qkvs = [world.qkv(18) for _ in LAYERS]
        for got, want in zip(run_layers(backend, batch, qkvs, plan=False), reference(world, batch, qkvs)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    wrappers = backend._graph_caches["verify-3x6"]._wrappers
    sliding, full = (wrappers[(MASKED, LayerConfig.of(layer))] for layer in LAYERS)
    assert sliding.buffers["mask"].data_ptr() != full.buffers["mask"].data_ptr()
    assert sliding.cfg[0] == -1 and full.cfg[0] == -1  # the window is in the sliding layer's mask


# -- GPU: captured in a CUDA graph, replayed over other trees ------------------------------------


class StaticVerify:
    """The device buffers a captured verify forward reads (as the graph runner keeps them)."""

    def __init__(self, world: TreeWorld, bs: int, num_nodes: int):
        n, dev = bs * num_nodes, world.device
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=dev)
        self.req_pool_indices = torch.zeros(bs, dtype=torch.int64, device=dev)
        self.seq_lens = torch.zeros(bs, dtype=torch.int32, device=dev)
        self.custom_mask = torch.zeros(n * world.max_len, dtype=torch.bool, device=dev)
        self.mask_indptr = torch.zeros(bs + 1, dtype=torch.int64, device=dev)
        self.qkvs = [world.qkv(n) for _ in LAYERS]

    def view(self, batch: ForwardBatch, qkvs) -> ForwardBatch:
        """Copy `batch` and the layers' q, k, v in; return the batch over the static buffers."""
        for name in ("positions", "out_cache_loc", "req_pool_indices", "seq_lens", "mask_indptr"):
            getattr(self, name).copy_(getattr(batch, name))
        size = batch.custom_mask.numel()
        self.custom_mask[:size].copy_(batch.custom_mask)
        for static, new in zip(self.qkvs, qkvs):
            for s, x in zip(static, new):
                s.copy_(x)
        return ForwardBatch(
            forward_mode=batch.forward_mode, batch_size=batch.batch_size, input_ids=batch.input_ids,
            positions=self.positions, req_pool_indices=self.req_pool_indices, seq_lens=self.seq_lens,
            seq_lens_cpu=batch.seq_lens_cpu, out_cache_loc=self.out_cache_loc,
            req_to_token_pool=batch.req_to_token_pool, token_to_kv_pool=batch.token_to_kv_pool,
            extend_prefix_lens=batch.extend_prefix_lens, extend_seq_lens=batch.extend_seq_lens,
            extend_prefix_lens_cpu=batch.extend_prefix_lens_cpu, extend_seq_lens_cpu=batch.extend_seq_lens_cpu,
            custom_mask=self.custom_mask[:size], mask_indptr=self.mask_indptr)


@pytest.mark.gpu
@pytest.mark.parametrize("backend_name", ["triton", "flashinfer"])
def test_graph_replay_windows_tree_nodes_by_position_gpu(backend_name):
    found = spec(backend_name)
    world, rng = TreeWorld(3, 200, dtype=torch.bfloat16, device="cuda", seed=7), random.Random(7)
    bs, num_nodes = 3, 8
    backend = found.factory(world.context())
    backend.init_graph_state(max_bs=bs, max_num_tokens=bs * num_nodes)
    static = StaticVerify(world, bs, num_nodes)
    first = world.verify((40, 3, 90), random_parents(bs, num_nodes, rng))
    capture = static.view(first, static.qkvs)
    run_layers(backend, capture, static.qkvs)  # eager warm-up (flashinfer learns its layer configs)
    backend.init_metadata_for_capture("verify", capture)
    run_layers(backend, capture, static.qkvs, plan=False)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run_layers(backend, capture, static.qkvs, plan=False)
    for prefixes in [(120, 17, 5), (6, 150, 61)]:
        batch = world.verify(prefixes, random_parents(bs, num_nodes, rng))
        qkvs = [world.qkv(batch.num_tokens) for _ in LAYERS]
        backend.init_metadata_for_replay("verify", static.view(batch, qkvs))
        graph.replay()
        for got, want in zip(outs, reference(world, batch, qkvs)):
            torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
