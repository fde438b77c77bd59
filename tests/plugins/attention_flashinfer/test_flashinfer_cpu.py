"""The flashinfer plugin where flashinfer and CUDA are absent (CI), plus its glue logic on the CPU.

1. Importing and registering the plugin touches neither flashinfer nor CUDA; `_available()` and
   the custom ops say why they cannot run; the ops fall back to native on CPU tensors.
2. The index builder and the routing of each forward mode, on CPU tensors.
3. The backend end to end against the torch_native reference, with a stand-in `flashinfer` module
   written here in plain torch that follows the 0.7.2 wrapper API (constructor and plan() keyword
   names, NHD page-size-1 caches, log2 LSEs, caller-owned graph buffers read at run time). It
   checks the backend's planning, routes, merges, masks and graph-buffer refresh; the real kernels
   are checked by tests/gpu/test_attention_flashinfer_gpu.py.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import types
import typing

import pytest
import torch

from backplane.contracts.attention import AttentionBackendContext, AttentionLayerInfo
from backplane.attention.torch_native import TorchNativeAttnBackend
from backplane.contracts.batch import ForwardBatch, ForwardMode
from backplane.contracts.memory import ReqToTokenPool, TokenToKVPool
from backplane.ops import native
from backplane.plugin.manager import load_plugins
from backplane.plugins import attention_flashinfer as plugin
from backplane.plugins.attention_flashinfer import ops
from backplane.plugins.attention_flashinfer.geometry import (
    MASKED,
    PAGED,
    RAGGED,
    RAGGED_PREFIX,
    ForwardGeometry,
    LayerConfig,
)
from backplane.plugins.attention_flashinfer.indices import build_kv_indices, indptr_from_lens, make_span
from backplane.plugins.attention_flashinfer.options import FlashInferOptions

# ------------------------------------------------------------------------------------------------
# 1. Unusable without CUDA / flashinfer, and importing it is free
# ------------------------------------------------------------------------------------------------

_IMPORT_CHECK = """
import sys, torch
from backplane.plugin.manager import load_plugins
plugin_set = load_plugins(only=["attention_flashinfer"])
info = [p for p in plugin_set.plugins if p.name == "attention_flashinfer"][0]
assert info.error is None, info.error
assert "attention:flashinfer" in info.registered, info.registered
spec = plugin_set.registry.specs("attention")["flashinfer"]
print(spec.available())
assert "flashinfer" not in sys.modules, "registering the plugin imported flashinfer"
assert not torch.cuda.is_initialized(), "registering the plugin initialised CUDA"
"""


def test_import_and_registration_touch_neither_flashinfer_nor_cuda(tmp_path):
    # A `flashinfer` on the path that fails loudly if anything imports it.
    (tmp_path / "flashinfer").mkdir()
    (tmp_path / "flashinfer" / "__init__.py").write_text("raise ImportError('flashinfer was imported')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", _IMPORT_CHECK], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() in ("None", "CUDA is not available on this machine")


def test_available_names_missing_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert plugin._available() == "CUDA is not available on this machine"


def test_available_names_missing_flashinfer_without_importing_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "flashinfer" else real_find_spec(name, *a)
    )
    assert plugin._available() == "flashinfer is not installed (pip install 'backplane-llm[flashinfer]')"
    assert "flashinfer" not in sys.modules


def test_spec_and_custom_ops_report_unusable_here(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    registry = load_plugins(only=["attention_flashinfer"]).registry
    spec = registry.specs("attention")["flashinfer"]
    assert spec.platforms == ("cuda",) and spec.dtypes == ("float16", "bfloat16")
    assert spec.available() == "CUDA is not available on this machine"
    impls = [impl for impl in registry.specs("custom_op").values() if impl.name == "flashinfer"]
    assert sorted(impl.op for impl in impls) == sorted(plugin.FLASHINFER_OPS)
    for impl in impls:
        assert impl.platform == "cuda" and impl.priority == 100
        assert impl.available() == "CUDA is not available on this machine"
    assert registry.specs("settings")["flashinfer"].model is FlashInferOptions


def test_ops_fall_back_to_native_on_cpu_tensors():
    torch.manual_seed(0)
    x, residual, w = torch.randn(5, 48), torch.randn(5, 48), torch.randn(48)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), native.rms_norm(x, w, 1e-6))
    y, r = ops.fused_add_rms_norm(x, residual, w, 1e-5)
    y_ref, r_ref = native.fused_add_rms_norm(x, residual, w, 1e-5)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(r, r_ref)
    torch.testing.assert_close(ops.silu_and_mul(x), native.silu_and_mul(x))
    torch.testing.assert_close(ops.gelu_and_mul(x, "tanh"), native.gelu_and_mul(x, "tanh"))
    with pytest.raises(ValueError, match="approximate: expected one of"):
        ops.gelu_and_mul(x, "erf")
    q, k = torch.randn(3, 4, 16), torch.randn(3, 2, 16)
    cache, pos = torch.randn(10, 16), torch.tensor([0, 9, 4])
    for got, ref in zip(ops.rotary_embedding(pos, q, k, cache, True), native.rotary_embedding(pos, q, k, cache, True)):
        torch.testing.assert_close(got, ref)
    assert "flashinfer" not in sys.modules


def test_decode_tensor_core_option():
    assert FlashInferOptions().use_tensor_cores(64, 8) is True  # group 8
    assert FlashInferOptions().use_tensor_cores(32, 8) is False  # group 4: the CUDA-core kernel
    assert FlashInferOptions().use_tensor_cores(32, 16) is False
    assert FlashInferOptions(decode_use_tensor_cores="true").use_tensor_cores(8, 8) is True
    assert FlashInferOptions(decode_use_tensor_cores="false").use_tensor_cores(32, 4) is False
    # an FP8 KV cache: tensor cores at any group under auto; "false" still forces the CUDA-core kernel
    assert FlashInferOptions().use_tensor_cores(32, 8, kv_fp8=True) is True
    assert FlashInferOptions().use_tensor_cores(8, 8, kv_fp8=True) is True
    assert FlashInferOptions().use_tensor_cores(32, 8, kv_fp8=False) is False
    assert FlashInferOptions(decode_use_tensor_cores="false").use_tensor_cores(32, 8, kv_fp8=True) is False


# ------------------------------------------------------------------------------------------------
# 2. Index building and routes
# ------------------------------------------------------------------------------------------------


def test_kv_indices_match_a_loop_over_requests():
    torch.manual_seed(1)
    req_to_token = torch.randint(1, 1000, (9, 40), dtype=torch.int32)
    rows = torch.tensor([7, 0, 3, 3, 8])
    lens = torch.tensor([13, 0, 1, 40, 7])
    span = make_span(req_to_token, rows, lens)
    expected = torch.cat([req_to_token[r, :n] for r, n in zip(rows.tolist(), lens.tolist())])
    assert span.indptr_cpu.tolist() == [0, 13, 13, 14, 54, 61]
    assert span.indices.dtype == torch.int32 and torch.equal(span.indices, expected)
    assert span.last_page_len_cpu.tolist() == [1] * 5
    # Into caller-owned buffers (CUDA graphs): written in place, the rest untouched.
    indptr_buf = torch.full((8,), -1, dtype=torch.int32)
    indices_buf = torch.full((100,), -1, dtype=torch.int32)
    span = make_span(req_to_token, rows, lens, indptr_buf, indices_buf)
    assert span.indices.data_ptr() == indices_buf.data_ptr()
    assert torch.equal(indices_buf[:61], expected) and bool((indices_buf[61:] == -1).all())
    assert indptr_buf[:6].tolist() == span.indptr_cpu.tolist() and indptr_buf[6:].tolist() == [-1, -1]
    with pytest.raises(ValueError, match="expected at most 50 KV indices"):
        make_span(req_to_token, rows, lens, indptr_buf, indices_buf[:50])


@pytest.mark.parametrize("use_kernel", [False, True], ids=["torch", "triton"])
def test_build_kv_indices_paths_match_a_loop(use_kernel):
    """Both gathers (torch ops; the one-launch Triton kernel, here under the interpreter) over rows
    longer than the kernel's block, empty requests and repeated rows."""
    torch.manual_seed(2)
    req_to_token = torch.randint(1, 5000, (6, 1300), dtype=torch.int32)
    rows = torch.tensor([5, 0, 2, 2, 4, 1])
    lens = torch.tensor([1300, 0, 513, 1, 512, 37])
    indptr = indptr_from_lens(lens)
    out = torch.full((int(indptr[-1]) + 4,), -1, dtype=torch.int32)
    build_kv_indices(req_to_token, rows, indptr, out[: int(indptr[-1])], use_kernel=use_kernel)
    expected = torch.cat([req_to_token[r, :n] for r, n in zip(rows.tolist(), lens.tolist())])
    assert torch.equal(out[: int(indptr[-1])], expected) and out[-4:].tolist() == [-1] * 4


def test_build_kv_indices_empty_and_indptr():
    assert indptr_from_lens(torch.tensor([2, 0, 5])).tolist() == [0, 2, 2, 7]
    out = torch.empty(0, dtype=torch.int32)
    build_kv_indices(torch.ones(2, 4, dtype=torch.int32), torch.tensor([0, 1]), torch.zeros(3, dtype=torch.int32), out)
    assert out.numel() == 0


# ------------------------------------------------------------------------------------------------
# Batches over a real KV pool (shared by the route tests and the end-to-end tests)
# ------------------------------------------------------------------------------------------------

MAX_CONTEXT = 64


def _make_batch(mode, seq_lens, new_lens, num_kv_heads=2, head_dim=16, num_layers=2, mask=False, seed=0,
                pools=None):
    """A ForwardBatch whose prefixes are already cached in a pool with shuffled slots.

    pools: (token_to_kv_pool, req_to_token_pool) to reuse (graph replays), else fresh random ones.
    Returns (batch, new (k, v) per layer).
    """
    gen = torch.Generator().manual_seed(seed)
    bs = len(seq_lens)
    total = sum(seq_lens)
    if pools is None:
        pool = TokenToKVPool(4 * MAX_CONTEXT, num_layers, num_kv_heads, head_dim, torch.float32, "cpu")
        req_pool = ReqToTokenPool(8, MAX_CONTEXT, "cpu")
        for layer in range(num_layers):  # random contents everywhere, including slots not yet written
            pool.k_buffers[layer].normal_(generator=gen)
            pool.v_buffers[layer].normal_(generator=gen)
    else:
        pool, req_pool = pools
    slots = pool.alloc(total)[torch.randperm(total, generator=gen)]
    rows = torch.randperm(req_pool.size, generator=gen)[:bs]
    out_cache_loc, start = [], 0
    for i, (seq_len, new) in enumerate(zip(seq_lens, new_lens)):
        req_pool.req_to_token[rows[i], :seq_len] = slots[start : start + seq_len].int()
        out_cache_loc.append(slots[start + seq_len - new : start + seq_len])
        start += seq_len
    num_tokens = sum(new_lens)
    custom_mask = mask_indptr = None
    if mask:
        blocks = [torch.rand(n, s, generator=gen) < 0.6 for n, s in zip(new_lens, seq_lens)]
        for block, s, n in zip(blocks, seq_lens, new_lens):
            block[torch.arange(n), torch.arange(s - n, s)] = True  # every query sees itself
        custom_mask = torch.cat([b.flatten() for b in blocks])
        mask_indptr = indptr_from_lens(torch.tensor([n * s for n, s in zip(new_lens, seq_lens)]))
    extend = not mode.is_decode
    new_lens_t = torch.tensor(new_lens, dtype=torch.int32)
    batch = ForwardBatch(
        forward_mode=mode,
        batch_size=bs,
        input_ids=torch.zeros(num_tokens, dtype=torch.int64),
        positions=torch.cat([torch.arange(s - n, s) for s, n in zip(seq_lens, new_lens)]),
        req_pool_indices=rows,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32),
        out_cache_loc=torch.cat(out_cache_loc),
        req_to_token_pool=req_pool,
        token_to_kv_pool=pool,
        extend_prefix_lens=torch.tensor(seq_lens, dtype=torch.int32) - new_lens_t if extend else None,
        extend_seq_lens=new_lens_t if extend else None,
        extend_prefix_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32) - new_lens_t if extend else None,
        extend_seq_lens_cpu=new_lens_t if extend else None,
        custom_mask=custom_mask,
        mask_indptr=mask_indptr,
    )
    new_kv = [
        (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen),
         torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen))
        for _ in range(num_layers)
    ]
    return batch, new_kv


NO_WINDOW = LayerConfig(-1, 0.0, 0.25)
WINDOW = LayerConfig(3, 0.0, 0.25)


@pytest.mark.parametrize(
    "mode, seq_lens, new_lens, mask, route, window_route",
    [
        (ForwardMode.EXTEND, [5, 9], [5, 9], False, RAGGED, RAGGED),
        (ForwardMode.EXTEND, [5, 9], [2, 9], False, RAGGED_PREFIX, PAGED),
        (ForwardMode.EXTEND, [5, 9], [2, 9], True, MASKED, MASKED),
        (ForwardMode.TARGET_VERIFY, [6, 9], [3, 3], True, MASKED, MASKED),
        (ForwardMode.TARGET_VERIFY, [6, 9], [3, 3], False, PAGED, PAGED),
        (ForwardMode.DRAFT_EXTEND, [6, 9], [2, 4], False, PAGED, PAGED),
    ],
)
def test_routes(mode, seq_lens, new_lens, mask, route, window_route):
    batch, _ = _make_batch(mode, seq_lens, new_lens, mask=mask)
    geo = ForwardGeometry(batch)
    assert geo.route(NO_WINDOW) == route and geo.route(WINDOW) == window_route
    assert geo.qo_indptr_cpu.tolist() == indptr_from_lens(torch.tensor(new_lens)).tolist()


def test_bad_custom_mask_and_lengths_are_named():
    batch, _ = _make_batch(ForwardMode.TARGET_VERIFY, [6, 9], [3, 3], mask=True)
    batch.custom_mask = batch.custom_mask[:-1]
    with pytest.raises(ValueError, match=r"custom_mask: expected at least 45 entries .* got 44"):
        ForwardGeometry(batch)
    batch, _ = _make_batch(ForwardMode.EXTEND, [6, 9], [3, 3])
    batch.extend_seq_lens_cpu = torch.tensor([3, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"expected the new tokens of the 2 requests to add up to num_tokens=6"):
        ForwardGeometry(batch)


def test_layer_config_window_is_inclusive_left():
    layer = AttentionLayerInfo(0, 4, 2, 16, 0.25, sliding_window=8, logit_softcap=30.0)
    assert LayerConfig.of(layer) == LayerConfig(7, 30.0, 0.25)
    assert LayerConfig.of(AttentionLayerInfo(0, 4, 2, 16, 0.25)).window_left == -1


# ------------------------------------------------------------------------------------------------
# 3. End to end against torch_native, with a plain-torch stand-in for flashinfer 0.7.2
# ------------------------------------------------------------------------------------------------


def _fake_attention(q, keys, values, causal, mask, window_left, soft_cap, sm_scale):
    """One request. q: [n, H, D]; keys, values: [m, Hk, D]; mask: [n, m] or None -> (o, lse in log2)."""
    n, m = q.shape[0], keys.shape[0]
    group = q.shape[1] // keys.shape[1]
    keys = keys.float().repeat_interleave(group, 1)
    values = values.float().repeat_interleave(group, 1)
    scores = torch.einsum("nhd,mhd->hnm", q.float(), keys) * sm_scale
    if soft_cap > 0:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    q_pos = torch.arange(m - n, m)[:, None]
    k_pos = torch.arange(m)[None, :]
    visible = mask if mask is not None else (k_pos <= q_pos if causal else torch.ones(n, m, dtype=torch.bool))
    if window_left >= 0:
        visible = visible & (k_pos >= q_pos - window_left)
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, n]
    probs = torch.nan_to_num(torch.exp(scores - lse[..., None]))
    o = torch.einsum("hnm,mhd->nhd", probs, values)
    return o, (lse / math.log(2)).T  # [n, H]


class _FakeWrapper:
    """Shared plan/run bookkeeping: host metadata at plan, device buffers read at run."""

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, **buffers):
        assert kv_layout == "NHD" and float_workspace_buffer.dtype == torch.uint8
        self.use_cuda_graph, self.buffers = use_cuda_graph, buffers

    def _store(self, name, value):
        """Graph mode copies into the caller's buffer (whose address the graph keeps); eager keeps a copy."""
        if self.use_cuda_graph:
            buf = self.buffers[name]
            if value is None:
                return buf
            buf[: value.numel()].copy_(value)
            return buf
        return None if value is None else value.clone()

    def _config(self, window_left, logits_soft_cap, sm_scale, q_data_type, kv_data_type):
        self.cfg = (window_left, logits_soft_cap or 0.0, sm_scale)
        self.dtypes = (q_data_type, kv_data_type)

    def _outputs(self, q, per_request, return_lse):
        o, lse = zip(*per_request)
        out = torch.cat(o).to(q.dtype)
        return (out, torch.cat(lse)) if return_lse else out


class FakePlanner:
    """Stands in for the compiled planner that 0.7.2's decode plan() calls, with its positional
    arguments (tensor-core "fa2" path: 20, CUDA-core decode path: 15). The plan names the batch it
    was made for (batch size and host indptr), so a run after a missed re-plan fails."""

    def __init__(self, tensor_cores: bool):
        self.tensor_cores, self.calls, self.inside_plan = tensor_cores, 0, False

    def plan(self, *args):
        self.calls += 1
        if self.tensor_cores:
            assert len(args) == 20, len(args)
            qo_indptr, indptr, kv_lens, rows, bs = args[3:8]
            assert qo_indptr.tolist() == list(range(bs + 1)) and rows == bs and args[11] is True
            assert kv_lens.tolist() == (indptr[1:] - indptr[:-1]).tolist()
        else:
            assert len(args) == 15, len(args)
            indptr, bs = args[3:5]
        assert indptr.device.type == "cpu" and indptr.dtype == torch.int32
        return [bs, *indptr.tolist()]


class FakeDecode(_FakeWrapper):
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 backend="auto", jit_args=None):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, indptr=paged_kv_indptr_buffer,
                         indices=paged_kv_indices_buffer, last=paged_kv_last_page_len_buffer)
        self._backend, self.use_tensor_cores = backend, use_tensor_cores
        self._float_workspace_buffer = float_workspace_buffer
        self._int_workspace_buffer = self._pin_memory_int_workspace_buffer = torch.empty(8, dtype=torch.uint8)
        self._cached_module = FakePlanner(use_tensor_cores)

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             window_left=-1, logits_soft_cap=None, q_data_type="float16", kv_data_type=None, sm_scale=None):
        assert page_size == 1 and bool((last_page_len == 1).all())
        self.indptr, self.indices = self._store("indptr", indptr), self._store("indices", indices)
        self._config(window_left, logits_soft_cap, sm_scale, q_data_type, kv_data_type)
        bs, work = len(last_page_len), (self._float_workspace_buffer, self._int_workspace_buffer,
                                        self._pin_memory_int_workspace_buffer)
        indptr = indptr.to("cpu")
        if self.use_tensor_cores:
            args = (*work, torch.arange(bs + 1, dtype=torch.int32), indptr, indptr[1:] - indptr[:-1], bs, bs,
                    num_qo_heads, num_kv_heads, page_size, self.use_cuda_graph, head_dim, head_dim, False,
                    window_left, -1, False, 0, 0)
        else:
            args = (*work, indptr, bs, num_qo_heads, num_kv_heads, page_size, self.use_cuda_graph, window_left,
                    logits_soft_cap or 0.0, head_dim, head_dim, torch.empty(0), torch.empty(0))
        self._cached_module.inside_plan = True
        self._plan_info = self._cached_module.plan(*args)
        self._cached_module.inside_plan = False

    def run(self, q, paged_kv_cache, *, return_lse=False):
        k_cache, v_cache = paged_kv_cache
        bs = q.shape[0]
        assert self._plan_info == [bs, *self.indptr[: bs + 1].tolist()], "run with the plan of another batch"
        per_request = []
        for i in range(bs):
            slots = self.indices[self.indptr[i] : self.indptr[i + 1]].long()
            per_request.append(_fake_attention(q[i : i + 1], k_cache[slots, 0], v_cache[slots, 0], True, None,
                                               *self.cfg))
        return self._outputs(q, per_request, return_lse)


class FakePrefillPlanner:
    """Stands in for the compiled planner that 0.7.2's paged prefill plan() calls ("fa2": 20 positional
    arguments). Its plan names the batch (query and key indptr), so a run of a graph whose buffers or
    plan belong to another batch fails."""

    def __init__(self):
        self.calls = 0

    def plan(self, *args):
        self.calls += 1
        assert len(args) == 20, len(args)
        qo_indptr, kv_indptr, kv_lens, max_rows, bs = args[3:8]
        for t in (qo_indptr, kv_indptr, kv_lens):
            assert t.device.type == "cpu" and t.dtype == torch.int32
        assert qo_indptr.numel() == kv_indptr.numel() == bs + 1 and max_rows >= int(qo_indptr[-1])
        assert kv_lens.tolist() == (kv_indptr[1:] - kv_indptr[:-1]).tolist()
        assert args[10] == 1 and isinstance(args[14], bool)  # page size, causal
        return [bs, *qo_indptr.tolist(), *kv_indptr.tolist()]


class FakePagedPrefill(_FakeWrapper):
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                 paged_kv_indptr_buf=None, paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None,
                 custom_mask_buf=None, mask_indptr_buf=None, backend="auto", jit_args=None):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, qo=qo_indptr_buf,
                         indptr=paged_kv_indptr_buf, indices=paged_kv_indices_buf, mask=custom_mask_buf)
        self._backend, self._qo_indptr_buf, self._max_total_num_rows = backend, qo_indptr_buf, None
        self._float_workspace_buffer = float_workspace_buffer
        self._int_workspace_buffer = self._pin_memory_int_workspace_buffer = torch.empty(8, dtype=torch.uint8)
        self._cached_module = FakePrefillPlanner()

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, packed_custom_mask=None,
             causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None, window_left=-1,
             logits_soft_cap=None, rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
             uniform_q_len=None):
        assert page_size == 1 and (custom_mask is None or custom_mask.dtype == torch.bool)
        self.qo, self.causal = self._store("qo", qo_indptr), causal
        self.indptr, self.indices = self._store("indptr", paged_kv_indptr), self._store("indices", paged_kv_indices)
        # (the real plan packs the mask into bits; here the bool mask goes into a bool stand-in buffer)
        self.mask = None if custom_mask is None else self._store_mask(custom_mask)
        self._config(window_left, logits_soft_cap, sm_scale, q_data_type, kv_data_type)
        qo_host, kv_host = qo_indptr.to("cpu"), paged_kv_indptr.to("cpu")
        total, bs = int(qo_host[-1]), qo_host.numel() - 1
        if self.use_cuda_graph and self._max_total_num_rows is None:
            self._max_total_num_rows = total
        work = (self._float_workspace_buffer, self._int_workspace_buffer, self._pin_memory_int_workspace_buffer)
        self._plan_info = self._cached_module.plan(
            *work, qo_host, kv_host, (kv_host[1:] - kv_host[:-1]).to(torch.int32), self._max_total_num_rows or total,
            bs, num_qo_heads, num_kv_heads, page_size, self.use_cuda_graph, head_dim_qk, head_dim_vo or head_dim_qk,
            causal, window_left, -1, False, 0, uniform_q_len or 0)

    def _store_mask(self, mask):
        if not self.use_cuda_graph:
            return mask.clone()
        assert self.buffers["mask"] is not None, "custom_mask_buf must be given in cuda graph mode"
        self.buffers.setdefault("mask_bool", torch.zeros(self.buffers["mask"].numel() * 8, dtype=torch.bool))
        self.buffers["mask_bool"][: mask.numel()] = mask
        return self.buffers["mask_bool"]

    def run(self, q, paged_kv_cache, *, return_lse=False):
        k_cache, v_cache = paged_kv_cache
        bs = self.qo.numel() - 1
        assert self._plan_info == [bs, *self.qo.tolist(), *self.indptr[: bs + 1].tolist()], \
            "run with the plan of another batch"
        per_request, mask_start = [], 0
        for i in range(bs):
            rows = slice(int(self.qo[i]), int(self.qo[i + 1]))
            slots = self.indices[self.indptr[i] : self.indptr[i + 1]].long()
            n, m = rows.stop - rows.start, slots.numel()
            mask = None
            if self.mask is not None:
                mask, mask_start = self.mask[mask_start : mask_start + n * m].view(n, m), mask_start + n * m
            per_request.append(_fake_attention(q[rows], k_cache[slots, 0], v_cache[slots, 0], self.causal, mask,
                                               *self.cfg))
        return self._outputs(q, per_request, return_lse)


class FakeRaggedPrefill(_FakeWrapper):
    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo=None,
             custom_mask=None, packed_custom_mask=None, causal=False, pos_encoding_mode="NONE",
             use_fp16_qk_reduction=False, window_left=-1, logits_soft_cap=None, sm_scale=None, rope_scale=None,
             rope_theta=None, q_data_type="float16", kv_data_type=None):
        self.qo, self.kv, self.causal = qo_indptr.clone(), kv_indptr.clone(), causal
        self._config(window_left, logits_soft_cap, sm_scale, q_data_type, kv_data_type)

    def run(self, q, k, v, *, return_lse=False):
        per_request = []
        for i in range(self.qo.numel() - 1):
            rows, keys = slice(int(self.qo[i]), int(self.qo[i + 1])), slice(int(self.kv[i]), int(self.kv[i + 1]))
            per_request.append(_fake_attention(q[rows], k[keys], v[keys], self.causal, None, *self.cfg))
        return self._outputs(q, per_request, return_lse)


def _fake_merge_state(v_a, s_a, v_b, s_b):
    s = torch.logaddexp2(s_a, s_b)
    w_a, w_b = torch.exp2(s_a - s)[..., None], torch.exp2(s_b - s)[..., None]
    return (v_a.float() * w_a + v_b.float() * w_b).to(v_a.dtype), s


@pytest.fixture
def fake_flashinfer(monkeypatch):
    module = types.ModuleType("flashinfer")
    module.BatchDecodeWithPagedKVCacheWrapper = FakeDecode
    module.BatchPrefillWithPagedKVCacheWrapper = FakePagedPrefill
    module.BatchPrefillWithRaggedKVCacheWrapper = FakeRaggedPrefill
    module.merge_state = _fake_merge_state
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return module


def _backend(batch, num_heads=4, num_kv_heads=2, head_dim=16, num_layers=2, options=None):
    from backplane.plugins.attention_flashinfer.backend import FlashInferAttnBackend

    ctx = AttentionBackendContext(
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, num_layers=num_layers,
        dtype=torch.float32, device=torch.device("cpu"), req_to_token_pool=batch.req_to_token_pool,
        token_to_kv_pool=batch.token_to_kv_pool, max_context_len=MAX_CONTEXT,
        options=options or FlashInferOptions(workspace_size_mb=16),
    )
    return FlashInferAttnBackend(ctx)


LAYERS = [  # layer 0 plain; layer 1 with a window and a soft cap (a second plan)
    AttentionLayerInfo(0, 4, 2, 16, 0.25),
    AttentionLayerInfo(1, 4, 2, 16, 0.3, sliding_window=4, logit_softcap=5.0),
]


def _run_both(backend, batch, new_kv, seed=3):
    """Run every layer through `backend` and torch_native on the same pool; return (ours, reference)."""
    reference = TorchNativeAttnBackend(backend.ctx)
    reference.init_forward_metadata(batch)
    gen = torch.Generator().manual_seed(seed)
    ours, refs = [], []
    for layer, (k, v) in zip(LAYERS, new_kv):
        q = torch.randn(batch.num_tokens, 4, 16, generator=gen)
        ours.append(backend.forward(q, k, v, layer, batch))
        refs.append(reference.forward(q, k, v, layer, batch))
    return ours, refs


@pytest.mark.parametrize(
    "mode, seq_lens, new_lens, mask",
    [
        (ForwardMode.EXTEND, [1, 7, 20], [1, 7, 20], False),  # no prefix: ragged only
        (ForwardMode.EXTEND, [1, 7, 20], [1, 3, 9], False),  # prefix: ragged + paged, merged
        (ForwardMode.EXTEND, [7, 20], [3, 9], True),  # extend with a custom mask
        (ForwardMode.DECODE, [1, 7, 20], [1, 1, 1], False),
        (ForwardMode.TARGET_VERIFY, [5, 9, 30], [4, 4, 4], True),  # tree mask
        (ForwardMode.DRAFT_EXTEND, [5, 9, 30], [2, 1, 3], False),
    ],
)
def test_backend_matches_torch_native(fake_flashinfer, mode, seq_lens, new_lens, mask):
    batch, new_kv = _make_batch(mode, seq_lens, new_lens, mask=mask)
    backend = _backend(batch)
    for _ in range(2):  # the first pass learns the layer configs, the second plans them up front
        backend.init_forward_metadata(batch)
        ours, refs = _run_both(backend, batch, new_kv)
        for got, ref in zip(ours, refs):
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert len(backend.layer_configs) == 2


def test_graph_buffers_are_refreshed_on_replay(fake_flashinfer):
    """Capture binds wrappers to the static buffers; replay with other lengths rewrites them in place."""
    batch, new_kv = _make_batch(ForwardMode.DECODE, [3, 11, 2], [1, 1, 1], seed=4)
    backend = _backend(batch)
    backend.init_graph_state(max_bs=4, max_num_tokens=4)
    backend.init_metadata_for_capture("decode-3", batch)
    _run_both(backend, batch, new_kv)  # warm-up: learns the configs, plans on the graph wrappers
    wrappers = dict(backend._graph_caches["decode-3"]._wrappers)
    pools = (batch.token_to_kv_pool, batch.req_to_token_pool)
    replay, replay_kv = _make_batch(ForwardMode.DECODE, [17, 1, 9], [1, 1, 1], seed=5, pools=pools)
    backend.init_metadata_for_replay("decode-3", replay)
    assert backend._graph_caches["decode-3"]._wrappers == wrappers  # same objects, same buffers
    ours, refs = _run_both(backend, replay, replay_kv)
    for got, ref in zip(ours, refs):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    # one decode wrapper per layer config, each re-planned by the short road (FakeDecode.run checks
    # that the plan is the replayed batch's)
    cache = backend._graph_caches["decode-3"]
    assert cache.fast_replans == 2 and all(cache.fast_decode.values())
    with pytest.raises(ValueError, match="captured for batch size 3 without a custom mask; got batch size 2"):
        backend.init_metadata_for_replay("decode-3", _make_batch(ForwardMode.DECODE, [3, 4], [1, 1])[0])
    with pytest.raises(ValueError, match="an EXTEND graph needs a token-bucket key"):
        backend.init_metadata_for_capture("x", _make_batch(ForwardMode.EXTEND, [3], [3])[0])


@pytest.mark.parametrize("tensor_cores", [True, False])
@pytest.mark.parametrize("planner", ["raises", "differs", "other_backend"])
def test_short_replan_is_used_only_where_it_equals_plan(fake_flashinfer, monkeypatch, caplog, planner,
                                                        tensor_cores):
    """Another FlashInfer (its planner takes other arguments, or plans otherwise) keeps plan() at every
    replay, and the replayed graph still attends over the new batch; the agreeing one takes the short road."""
    from backplane.plugins.attention_flashinfer import wrappers

    class OtherPlanner(FakePlanner):
        def plan(self, *args):
            if not self.inside_plan and planner == "raises":  # called as another FlashInfer's plan() does not
                raise TypeError("plan() takes 21 positional arguments")
            info = super().plan(*args)
            return info + [self.calls] if planner == "differs" else info

    original_init = FakeDecode.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self._cached_module = OtherPlanner(self.use_tensor_cores)
        if planner == "other_backend":
            self._backend = "trtllm-gen"

    monkeypatch.setattr(FakeDecode, "__init__", init)
    monkeypatch.setattr(FakeDecode, "run", lambda self, q, kv, return_lse=False: _unchecked_run(self, q, kv))
    batch, new_kv = _make_batch(ForwardMode.DECODE, [3, 11], [1, 1], seed=4)
    options = FlashInferOptions(workspace_size_mb=16, decode_use_tensor_cores="true" if tensor_cores else "false")
    backend = _backend(batch, options=options)
    backend.init_graph_state(max_bs=2, max_num_tokens=2)
    backend.init_metadata_for_capture("decode-2", batch)
    _run_both(backend, batch, new_kv)
    pools = (batch.token_to_kv_pool, batch.req_to_token_pool)
    replay, replay_kv = _make_batch(ForwardMode.DECODE, [17, 5], [1, 1], seed=5, pools=pools)
    backend.init_metadata_for_replay("decode-2", replay)
    ours, refs = _run_both(backend, replay, replay_kv)
    for got, ref in zip(ours, refs):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    cache = backend._graph_caches["decode-2"]
    assert cache.fast_replans == 0 and not any(cache.fast_decode.values())
    assert all(w.use_tensor_cores == tensor_cores for w in cache._wrappers.values())
    assert ("does not fit this FlashInfer" in caplog.text) == (planner == "raises")
    assert wrappers.DECODE in {role for role, _ in cache._wrappers}


class _BucketKey(typing.NamedTuple):  # what the backend reads of a graph key: an EXTEND graph's is ragged
    name: str
    ragged: bool = True


@pytest.mark.parametrize("planner", ["agrees", "raises", "differs"])
def test_extend_graph_replays_take_the_short_paged_replan(fake_flashinfer, monkeypatch, caplog, planner):
    """An EXTEND graph's causal paged wrappers are re-planned by the short road once it proved equal
    to plan(): the replayed graph then reads the new batch's query indptr and plan (FakePagedPrefill.run
    checks both against its buffers). A planner that disagrees keeps plan() at every replay."""
    from backplane.plugins.attention_flashinfer import wrappers

    if planner != "agrees":
        class OtherPlanner(FakePrefillPlanner):
            def plan(self, *args):
                if planner == "raises" and args[-1] == 0 and args[13] == 16 and self.calls and not self.inside:
                    raise TypeError("plan() takes 21 positional arguments")
                info = super().plan(*args)
                return info + [self.calls] if planner == "differs" else info

        original_plan = FakePagedPrefill.plan

        def plan(self, *args, **kwargs):  # the planner as plan() calls it (the short road calls it bare)
            self._cached_module.inside = True
            try:
                original_plan(self, *args, **kwargs)
            finally:
                self._cached_module.inside = False

        original_init = FakePagedPrefill.__init__

        def init(self, *args, **kwargs):
            original_init(self, *args, **kwargs)
            self._cached_module = OtherPlanner()
            self._cached_module.inside = False

        monkeypatch.setattr(FakePagedPrefill, "__init__", init)
        monkeypatch.setattr(FakePagedPrefill, "plan", plan)
        monkeypatch.setattr(FakePagedPrefill, "run", _plan_unchecked(FakePagedPrefill.run))
    key = _BucketKey("extend-2")
    batch, new_kv = _make_batch(ForwardMode.EXTEND, [6, 14], [6, 10], seed=4)  # 16 tokens: the bucket
    backend = _backend(batch)
    backend.init_graph_state(max_bs=2, max_num_tokens=16)
    backend.init_metadata_for_capture(key, batch)
    _run_both(backend, batch, new_kv)  # warm-up: learns the configs, plans on the graph wrappers
    pools = (batch.token_to_kv_pool, batch.req_to_token_pool)
    for seed, (seq_lens, new_lens) in enumerate([([9, 3], [2, 3]), ([20, 5], [7, 1]), ([1, 14], [1, 14])]):
        replay, replay_kv = _make_batch(ForwardMode.EXTEND, seq_lens, new_lens, seed=5 + seed, pools=pools)
        backend.init_metadata_for_replay(key, replay)
        ours, refs = _run_both(backend, replay, replay_kv)
        for got, ref in zip(ours, refs):
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    cache = backend._graph_caches[key]
    assert {role for role, _ in cache._wrappers} == {wrappers.PAGED}
    if planner == "agrees":  # the capture's first plan proved the road for each of the 2 layer configs
        assert all(cache.fast_plan.values()) and len(cache.fast_plan) == 2
        assert cache.fast_replans == 6 and cache.fast_decode is cache.fast_plan  # 3 replays x 2 configs
    else:
        assert cache.fast_replans == 0 and not any(cache.fast_plan.values())
    assert ("short paged re-plan does not fit" in caplog.text) == (planner == "raises")


def _plan_unchecked(run):
    """FakePagedPrefill.run without its plan check (the planners above return other plans)."""
    def unchecked(self, q, paged_kv_cache, *, return_lse=False):
        info, bs = self._plan_info, self.qo.numel() - 1
        self._plan_info = [bs, *self.qo.tolist(), *self.indptr[: bs + 1].tolist()]
        try:
            return run(self, q, paged_kv_cache, return_lse=return_lse)
        finally:
            self._plan_info = info
    return unchecked


def _unchecked_run(wrapper, q, paged_kv_cache):
    """FakeDecode.run without its plan check (the planners of the test above return other plans)."""
    k_cache, v_cache = paged_kv_cache
    per_request = []
    for i in range(q.shape[0]):
        slots = wrapper.indices[wrapper.indptr[i] : wrapper.indptr[i + 1]].long()
        per_request.append(_fake_attention(q[i : i + 1], k_cache[slots, 0], v_cache[slots, 0], True, None,
                                           *wrapper.cfg))
    return wrapper._outputs(q, per_request, False)


@pytest.mark.parametrize(
    "mode, seq_lens, new_lens",
    [(ForwardMode.EXTEND, [1, 7, 20], [1, 3, 9]), (ForwardMode.EXTEND, [4, 9], [4, 9]),
     (ForwardMode.DECODE, [1, 7, 20], [1, 1, 1])],
)
def test_attention_layer_writes_kv_with_rotary_for_flashinfer(fake_flashinfer, mode, seq_lens, new_lens):
    """The backend opts in to `fuses_rotary_kv_write`: the attention layer rotates and writes K/V in
    one op and calls it with kv_written=True. Output and pool equal the unfused layer over
    torch_native (which rotates, then writes K/V itself), on every route (ragged, ragged+prefix, decode)."""
    from backplane.layers.attention import Attention
    from backplane.layers.rotary import RotaryEmbedding
    from backplane.ops.dispatch import CustomOps

    outputs, pools = [], []
    for name in ("flashinfer", "torch_native"):
        batch, _ = _make_batch(mode, seq_lens, new_lens, seed=7)
        backend = _backend(batch) if name == "flashinfer" else TorchNativeAttnBackend(_backend(batch).ctx)
        assert backend.fuses_rotary_kv_write(batch) == (name == "flashinfer")
        ctx = types.SimpleNamespace(attn_backend=backend, ops=CustomOps.native())
        rotary = RotaryEmbedding(16, 16, MAX_CONTEXT, 10000.0, None, True, ctx)
        layer = Attention(4, 2, 16, 0.25, 0, ctx)
        gen = torch.Generator().manual_seed(8)
        q, k, v = (torch.randn(batch.num_tokens, h * 16, generator=gen) for h in (4, 2, 2))
        calls = []
        real_forward = backend.forward
        backend.forward = _recording(real_forward, calls)
        backend.init_forward_metadata(batch)
        outputs.append(layer(q, k, v, batch, rotary=rotary, positions=batch.positions))
        assert calls == [name == "flashinfer"]
        pools.append((batch.token_to_kv_pool.k_buffers[0].clone(), batch.token_to_kv_pool.v_buffers[0].clone()))
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=1e-5)
    for ours, ref in zip(pools[0], pools[1]):
        torch.testing.assert_close(ours, ref)


def _recording(forward, calls: list):
    """`forward`, appending each call's kv_written to `calls`."""
    def wrapped(*args, **kwargs):
        calls.append(kwargs.get("kv_written", False))
        return forward(*args, **kwargs)
    return wrapped


def test_verify_graph_with_tree_mask(fake_flashinfer):
    batch, new_kv = _make_batch(ForwardMode.TARGET_VERIFY, [5, 9], [3, 3], mask=True, seed=6)
    backend = _backend(batch)
    backend.init_graph_state(max_bs=2, max_num_tokens=6)
    backend.init_metadata_for_capture("verify-2", batch)
    ours, refs = _run_both(backend, batch, new_kv)
    for got, ref in zip(ours, refs):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_layer_with_other_heads_is_rejected(fake_flashinfer):
    batch, new_kv = _make_batch(ForwardMode.DECODE, [3], [1])
    backend = _backend(batch)
    with pytest.raises(RuntimeError, match="init_forward_metadata must run"):
        backend.forward(torch.randn(1, 4, 16), *new_kv[0], LAYERS[0], batch)
    backend.init_forward_metadata(batch)
    with pytest.raises(ValueError, match=r"expected \(num_heads, num_kv_heads, head_dim\) \(4, 2, 16\)"):
        backend.forward(torch.randn(1, 8, 16), *new_kv[0], AttentionLayerInfo(0, 8, 2, 16, 0.25), batch)


def test_merge_of_two_key_sets_equals_attention_over_both():
    """The torch merge path (used when FlashInfer's merge kernel cannot launch that many heads)."""
    from backplane.plugins.attention_flashinfer.wrappers import merge_attention

    torch.manual_seed(7)
    q = torch.randn(5, 128, 64)  # 128 heads x 16 threads > 1024: the torch path
    keys, values = torch.randn(37, 8, 64), torch.randn(37, 8, 64)
    o_a, lse_a = _fake_attention(q, keys[:30], values[:30], False, None, -1, 0.0, 0.125)
    o_b, lse_b = _fake_attention(q, keys[30:], values[30:], True, None, -1, 0.0, 0.125)
    expected, _ = _fake_attention(q, keys, values, True, None, -1, 0.0, 0.125)
    torch.testing.assert_close(merge_attention(o_a, lse_a, o_b, lse_b), expected, atol=1e-5, rtol=1e-5)
    assert "flashinfer" not in sys.modules
