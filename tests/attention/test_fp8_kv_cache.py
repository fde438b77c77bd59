"""The FP8 KV cache (--kv-cache-dtype fp8_e4m3) on CPU: the pool's quantization, the checkpoint's
scales, torch_native as the FP8 reference, the triton kernels under the Triton interpreter, the
selection refusal and an engine that generates over an FP8 pool. tests/gpu/test_fp8_kv_gpu.py runs
triton and flashinfer on the GPU, graphs included.

Tolerances: torch_native over the FP8 pool equals torch_native over an fp32 pool holding the same
dequantized values to 1e-6 (the same fp32 arithmetic). Against the unquantized cache the output
differs by float8_e4m3fn rounding, a relative error of up to 2^-4 per stored value (3 mantissa
bits; rms 2^-4 / sqrt(3) = 0.036): `assert_loose` asks a relative rms error under 0.06 and an
absolute one under 0.25 on outputs up to about 3 (measured: 0.034 to 0.043 and 0.06 to 0.17).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel is defined (see the triton tests' note)

import importlib  # noqa: E402
import sys  # noqa: E402

from backplane.attention.torch_native import TorchNativeAttnBackend  # noqa: E402
from backplane.contracts.attention import AttentionBackendContext, AttentionLayerInfo  # noqa: E402
from backplane.contracts.batch import ForwardBatch, ForwardMode  # noqa: E402
from backplane.contracts.memory import (  # noqa: E402
    FP8_E4M3,
    FP8_E4M3_MAX,
    ReqToTokenPool,
    TokenToKVPool,
    dequantize_kv,
    quantize_fp8,
)
from backplane.executor.kv_scales import KVCacheScales, checkpoint_kv_cache_dtype, kv_scale_target  # noqa: E402
from backplane.plugin.registry import AttentionBackendSpec, Registry  # noqa: E402
from backplane.plugin.selection import AttentionRequirements, SelectionError, select_attention_backend  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32
LAYER = AttentionLayerInfo(1, HEADS, KV_HEADS, HEAD_DIM, scaling=0.25)  # layer 1: a backend reading layer 0 fails
K_SCALE, V_SCALE = 0.05, 0.02  # layer 1's; keys and values ~ N(0, 1) stay below 448 * scale


def assert_loose(got: torch.Tensor, unquantized: torch.Tensor, what: str) -> None:
    """FP8 KV against the unquantized cache: within e4m3 rounding (see the module docstring)."""
    rel_rms = float((got - unquantized).norm() / unquantized.norm())
    worst = float((got - unquantized).abs().max())
    assert rel_rms < 0.06 and worst < 0.25, f"{what}: relative rms error {rel_rms:.4f}, max error {worst:.4f}"


def qdq(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What an FP8 pool gives back for x: quantized, then dequantized (fp32)."""
    return dequantize_kv(quantize_fp8(x, scale), scale)


# -- the pool ------------------------------------------------------------------------------------


def test_pool_round_trip_saturation_and_scales():
    pool = TokenToKVPool(16, 2, KV_HEADS, HEAD_DIM, FP8_E4M3, "cpu")
    assert pool.is_fp8 and pool.kv_scales(0) == (1.0, 1.0)
    pool.set_kv_scales(1, K_SCALE, V_SCALE)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(5, KV_HEADS, HEAD_DIM, generator=gen) * 2
    v = torch.randn(5, KV_HEADS, HEAD_DIM, generator=gen)
    k[0, 0, :4] = torch.tensor([100.0, -100.0, 22.4, 1e6])  # beyond 448 * 0.05 = 22.4: saturates (22.4 is exact)
    loc = torch.tensor([3, 9, 1, 16, 7])
    pool.set_kv_buffer(1, loc, k, v)
    k_buf, v_buf = pool.get_kv_buffer(1)
    assert k_buf.dtype == FP8_E4M3 and k_buf.shape == (17, KV_HEADS, HEAD_DIM)
    got_k, got_v = dequantize_kv(k_buf[loc], K_SCALE), dequantize_kv(v_buf[loc], V_SCALE)
    assert torch.equal(k_buf[loc][0, 0, :4].float(), torch.tensor([448.0, -448.0, 448.0, 448.0]))
    in_range = k.abs() < FP8_E4M3_MAX * K_SCALE
    # e4m3 keeps 3 mantissa bits: round to nearest is within 2^-4 relative (or half the smallest subnormal)
    assert ((got_k - k).abs() <= (k.abs() * 2**-4 + 2**-10 * K_SCALE))[in_range].all()
    assert ((got_v - v).abs() <= v.abs() * 2**-4 + 2**-10 * V_SCALE).all()
    assert torch.equal(got_k, (k / K_SCALE).clamp(-448, 448).to(FP8_E4M3).float() * K_SCALE)
    assert torch.equal(pool.get_kv_buffer(0)[0][loc].float(), torch.zeros(5, KV_HEADS, HEAD_DIM))  # layer 0 untouched


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_unit_scale_quantization_equals_the_fp32_path_for_every_half_value(dtype):
    """quantize_fp8's short path (scale 1.0, a bf16/fp16 input: clamp and cast as it is) against the
    fp32 path it skips, over all 65,536 bit patterns of the type: every non-NaN value gives the same
    byte, and NaN stays NaN. A scale other than 1.0 still divides in fp32 (a bf16 division would
    round x / scale first: planted below, it differs)."""
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    nan = torch.isnan(x.float())
    fast = quantize_fp8(x, 1.0)
    slow = x.float().clamp(-448.0, 448.0).to(FP8_E4M3)
    assert torch.equal(fast.view(torch.uint8)[~nan], slow.view(torch.uint8)[~nan])
    assert torch.isnan(fast[nan].float()).all()
    scaled = quantize_fp8(x[~nan], 0.37)
    assert torch.equal(scaled.view(torch.uint8), (x[~nan].float() / 0.37).clamp(-448.0, 448.0).to(FP8_E4M3).view(torch.uint8))
    in_half = (x[~nan] / 0.37).clamp(-448.0, 448.0).to(FP8_E4M3)
    assert not torch.equal(scaled.view(torch.uint8), in_half.view(torch.uint8))


def test_pool_bytes_per_token_halve_and_bad_scales_are_refused():
    bf16 = TokenToKVPool.bytes_per_token(4, 8, 128, torch.bfloat16)
    assert TokenToKVPool.bytes_per_token(4, 8, 128, FP8_E4M3) * 2 == bf16
    plain = TokenToKVPool(4, 1, 1, 8, torch.float32, "cpu")
    plain.set_kv_scales(0, 0.5, 0.5)
    assert not plain.is_fp8 and plain.kv_scales(0) == (1.0, 1.0)  # only an FP8 pool scales
    pool = TokenToKVPool(4, 2, 1, 8, FP8_E4M3, "cpu")
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="layer 1 k_scale: expected a finite positive KV cache scale"):
            pool.set_kv_scales(1, bad, 1.0)
    with pytest.raises(ValueError, match="layer 2 out of range; the pool has 2 layers"):
        pool.set_kv_scales(2, 1.0, 1.0)


# -- checkpoint scales ---------------------------------------------------------------------------


@pytest.mark.parametrize("name,target", [
    ("model.layers.3.self_attn.k_scale", (3, "k")),
    ("model.layers.3.self_attn.v_scale", (3, "v")),
    ("model.layers.12.self_attn.attn.k_scale", (12, "k")),
    ("model.layers.0.self_attn.v_proj.output_scale", (0, "v")),
    ("model.layers.5.self_attn.k_proj.k_scale", (5, "k")),
    ("model.layers.5.self_attn.kv_scale", (5, "kv")),
    ("model.layers.5.self_attn.q_scale", (5, "q")),
    ("model.layers.5.self_attn.k_proj.weight_scale", None),
    ("model.layers.5.self_attn.k_proj.input_scale", None),
    ("model.layers.5.mlp.down_proj.output_scale", None),
    ("model.layers.5.self_attn.k_proj.v_scale", None),
])
def test_kv_scale_names(name, target):
    assert kv_scale_target(name) == target


def test_checkpoint_scales_reach_the_pool():
    scales = KVCacheScales()
    offered = {
        "model.layers.1.self_attn.k_scale": torch.tensor(K_SCALE),
        "model.layers.1.self_attn.v_scale": torch.tensor([V_SCALE]),
        "model.layers.0.self_attn.kv_scale": torch.tensor(0.5, dtype=torch.bfloat16),
        "model.layers.0.self_attn.q_scale": torch.tensor(3.0),
        "model.layers.0.self_attn.q_proj.weight": torch.ones(2, 2),
    }
    taken = [name for name, tensor in offered.items() if scales.offer(name, tensor, "model.safetensors")]
    assert taken == list(offered)[:4]
    pool = TokenToKVPool(4, 3, 1, 8, FP8_E4M3, "cpu")
    scales.apply(pool)
    assert [pool.kv_scales(i) for i in range(3)] == [(0.5, 0.5), (pytest.approx(K_SCALE), pytest.approx(V_SCALE)),
                                                    (1.0, 1.0)]
    with pytest.raises(ValueError, match=r"^model.safetensors: tensor model.layers.2.self_attn.k_scale: expected one "
                                         r"per-tensor KV cache scale, got shape \[2\]"):
        scales.offer("model.layers.2.self_attn.k_scale", torch.ones(2), "model.safetensors")
    with pytest.raises(ValueError, match="the checkpoint has scales for layer 1 but the model has 1 attention layers"):
        scales.apply(TokenToKVPool(4, 1, 1, 8, FP8_E4M3, "cpu"))


def test_checkpoint_kv_cache_scheme():
    fp8 = {"kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}
    assert checkpoint_kv_cache_dtype(fp8, "config.json") == "fp8_e4m3"
    assert checkpoint_kv_cache_dtype({"quant_method": "compressed-tensors"}, "config.json") is None
    assert checkpoint_kv_cache_dtype(None, "config.json") is None
    per_head = {"kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "attn_head", "dynamic": False}}
    with pytest.raises(ValueError, match=r"^config.json: quantization_config.kv_cache_scheme .*'strategy': "
                                         "'attn_head'.*expected static per-tensor FP8"):
        checkpoint_kv_cache_dtype(per_head, "config.json")


# -- attention over an FP8 pool --------------------------------------------------------------------


def tree_mask(prefix: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """[n, prefix + n]: every node sees the prefix, itself and a random chain of earlier nodes."""
    mask = torch.zeros(n, prefix + n, dtype=torch.bool)
    mask[:, :prefix] = True
    for i in range(n):
        parent = int(torch.randint(0, i, (), generator=gen)) if i else -1
        mask[i, prefix + i] = True
        if parent >= 0:
            mask[i] |= mask[parent]
    return mask


class World:
    """One request pool over three KV pools with the same slots: "fp8" (layer scales set), "qdq"
    (fp32 holding what the FP8 pool gives back) and "raw" (fp32, unquantized)."""

    def __init__(self, prefix_lens: list[int], seed: int):
        self.gen = torch.Generator().manual_seed(seed)
        self.req_pool = ReqToTokenPool(len(prefix_lens) + 1, 256, "cpu")
        self.pools = {name: TokenToKVPool(400, 2, KV_HEADS, HEAD_DIM, dtype, "cpu")
                      for name, dtype in (("fp8", FP8_E4M3), ("qdq", torch.float32), ("raw", torch.float32))}
        self.pools["fp8"].set_kv_scales(0, 0.7, 0.3)
        self.pools["fp8"].set_kv_scales(1, K_SCALE, V_SCALE)
        self.free = torch.randperm(400, generator=self.gen).add(1).tolist()
        self.rows = [self.req_pool.alloc() for _ in prefix_lens]
        self.lens = [0] * len(prefix_lens)
        loc = self._place(prefix_lens)
        self.write(loc, *self.random_kv(len(loc)))

    def random_kv(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (n, KV_HEADS, HEAD_DIM)
        return torch.randn(shape, generator=self.gen), torch.randn(shape, generator=self.gen)

    def write(self, loc, k, v) -> None:
        self.pools["fp8"].set_kv_buffer(LAYER.layer_id, loc, k, v)
        self.pools["qdq"].set_kv_buffer(LAYER.layer_id, loc, qdq(k, K_SCALE), qdq(v, V_SCALE))
        self.pools["raw"].set_kv_buffer(LAYER.layer_id, loc, k, v)

    def _place(self, counts: list[int]) -> torch.Tensor:
        loc = []
        for i, n in enumerate(counts):
            slots = [self.free.pop() for _ in range(n)]
            self.req_pool.req_to_token[self.rows[i], self.lens[i]:self.lens[i] + n] = torch.tensor(slots)
            self.lens[i] += n
            loc += slots
        return torch.tensor(loc, dtype=torch.int64)

    def step(self, mode: ForwardMode, new_lens: list[int], masked: bool = False) -> dict[str, ForwardBatch]:
        """One batch per pool (the same requests, slots and mask)."""
        prefix = list(self.lens)
        loc = self._place(new_lens)
        seq = torch.tensor(self.lens, dtype=torch.int32)
        extra = {}
        if masked:
            masks = [tree_mask(p, n, self.gen).flatten() for p, n in zip(prefix, new_lens)]
            extra["custom_mask"] = torch.cat(masks)
            extra["mask_indptr"] = torch.tensor([0, *torch.tensor([m.numel() for m in masks]).cumsum(0).tolist()])
        batches = {}
        for name, pool in self.pools.items():
            batch = ForwardBatch(
                forward_mode=mode, batch_size=len(new_lens), input_ids=torch.zeros(len(loc), dtype=torch.int64),
                positions=torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, new_lens)]),
                req_pool_indices=torch.tensor(self.rows), seq_lens=seq, seq_lens_cpu=seq.clone(),
                out_cache_loc=loc, req_to_token_pool=self.req_pool, token_to_kv_pool=pool, **extra)
            if mode is not ForwardMode.DECODE:
                batch.set_extend_lens(prefix, new_lens)
            batches[name] = batch
        return batches

    def context(self, pool: str, options=None) -> AttentionBackendContext:
        return AttentionBackendContext(HEADS, KV_HEADS, HEAD_DIM, 2, torch.float32, torch.device("cpu"),
                                       self.req_pool, self.pools[pool], max_context_len=256, options=options)


def run(backend, batch: ForwardBatch, q, k, v) -> torch.Tensor:
    backend.init_forward_metadata(batch)
    return backend.forward(q, k, v, LAYER, batch)


STEPS = [  # (mode, new tokens per request, tree mask): a prefill and an extend over it, decode, verify
    (ForwardMode.EXTEND, [7, 1, 9], False),
    (ForwardMode.DECODE, [1, 1, 1], False),
    (ForwardMode.TARGET_VERIFY, [4, 4, 4], True),
    (ForwardMode.DRAFT_EXTEND, [2, 3, 1], True),
]


def test_torch_native_fp8_is_the_dequantized_cache():
    """Every mode: the FP8 pool's output equals an fp32 pool of the dequantized values (tight) and
    the unquantized one within e4m3 rounding; the new tokens are stored quantized."""
    world = World([0, 5, 40], seed=1)
    backend = TorchNativeAttnBackend(None)
    for mode, new_lens, masked in STEPS:
        batches = world.step(mode, new_lens, masked)
        n = sum(new_lens)
        q = torch.randn(n, HEADS, HEAD_DIM, generator=world.gen)
        k, v = world.random_kv(n)
        fp8 = run(backend, batches["fp8"], q, k, v)
        same = run(backend, batches["qdq"], q, qdq(k, K_SCALE), qdq(v, V_SCALE))
        raw = run(backend, batches["raw"], q, k, v)
        torch.testing.assert_close(fp8, same, atol=1e-6, rtol=0, msg=f"{mode.value}: fp8 vs dequantized")
        assert_loose(fp8, raw, f"{mode.value}: fp8 vs unquantized")
        assert not torch.equal(fp8, raw), "the FP8 cache changed nothing: the scales or the quantization are unused"
        stored = world.pools["fp8"].get_kv_buffer(LAYER.layer_id)[0][batches["fp8"].out_cache_loc]
        assert torch.equal(stored, quantize_fp8(k, K_SCALE))


def _interpreted_triton() -> None:
    """Skip unless on CPU; the triton plugin's kernel modules defined under the interpreter."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("interpreter tests run on CPU-only machines (tests/gpu/test_fp8_kv_gpu.py covers CUDA)")
    for name in ("tile_ops", "decode_kernels", "extend_kernels", "verify_kernels", "backend"):
        module = sys.modules.get(f"backplane.plugins.attention_triton.{name}")
        if module is not None and not getattr(module, "_fp8_interpreted", False):
            importlib.reload(module)  # NOTE: defined before TRITON_INTERPRET was set: interpret them now
            module._fp8_interpreted = True


def _triton_backend(ctx):
    _interpreted_triton()
    from backplane.plugins import attention_triton

    specs = []
    attention_triton.backplane_register_attention_backends(register=specs.append)
    (spec,) = specs
    assert "fp8_e4m3" in spec.kv_cache_dtypes and spec.available() is None
    return spec.factory(ctx)


@pytest.mark.parametrize("options", [dict(verify_kernel="split"), dict(verify_kernel="extend", num_kv_splits=2)],
                         ids=["split-verify", "extend-verify-2-splits"])
def test_triton_interpreted_matches_torch_native_over_fp8(options):
    """Decode, extend (the new tokens quantized as the pool stores them), verify (the split-KV kernel
    or the extend kernel) and draft extend over the FP8 pool equal torch_native over it; the fused
    rotary + KV write is declined."""
    from backplane.plugins.attention_triton.options import TritonAttentionOptions

    world = World([0, 5, 40], seed=2)
    triton_backend = _triton_backend(world.context("fp8", TritonAttentionOptions(**options)))
    for batch in _every_step_matches_torch_native(world, triton_backend):
        assert not triton_backend.fuses_rotary_kv_write(batch)


def _every_step_matches_torch_native(world, backend):
    """Each of STEPS over the world's FP8 pool: `backend` equals torch_native; yields each batch."""
    reference = TorchNativeAttnBackend(None)
    for mode, new_lens, masked in STEPS:
        batch = world.step(mode, new_lens, masked)["fp8"]
        n = sum(new_lens)
        q = torch.randn(n, HEADS, HEAD_DIM, generator=world.gen)
        k, v = world.random_kv(n)
        torch.testing.assert_close(run(backend, batch, q, k, v), run(reference, batch, q, k, v),
                                   atol=2e-4, rtol=2e-4, msg=f"{mode.value}")
        yield batch


# -- the triton kernels' launch settings for 1-byte K/V ------------------------------------------------

HOPPER, A100, ADA = (9, 0), (8, 0), (8, 9)
CUDA = torch.device("cuda")  # a name only: decode_config asks the (monkeypatched) capability


@pytest.fixture
def cuda_capability(monkeypatch):
    """Sets the compute capability torch reports (decode_config's cache cleared around it)."""
    from backplane.plugins.attention_triton import configs

    def set_capability(capability: tuple[int, int]) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        configs.decode_config.cache_clear()

    yield set_capability
    configs.decode_config.cache_clear()


def test_decode_config_takes_five_stages_for_fp8_kv_on_hopper(cuda_capability):
    """Hopper: 1-byte K/V get five pipeline stages of 64 keys (80 KB of K and V tiles, what the
    H200 FP8 sweep picked); 2-byte K/V (and the old two-argument call) keep four stages of 64 keys
    (128 KB). Ampere, Ada, head dims over 128 and the interpreter ignore the element size."""
    from backplane.plugins.attention_triton.configs import DecodeConfig, decode_config

    cuda_capability(HOPPER)
    fp8, bf16 = decode_config(128, CUDA, 1), decode_config(128, CUDA, 2)
    assert (fp8.block_n, fp8.num_warps, fp8.num_stages, fp8.min_split) == (64, 4, 5, 128)
    assert bf16 == decode_config(128, CUDA) == DecodeConfig(block_n=64, num_warps=4, num_stages=4, min_split=128)
    for cfg, kv_bytes, kb in ((fp8, 1, 80), (bf16, 2, 128)):  # stages x keys x head dim x bytes x (K and V)
        assert cfg.num_stages * cfg.block_n * 128 * kv_bytes * 2 == kb << 10
    assert decode_config(64, CUDA, 1).num_stages == 5 and decode_config(64, CUDA, 2).num_stages == 4
    assert decode_config(256, CUDA, 1) == decode_config(256, CUDA, 2) == DecodeConfig(block_n=32, num_stages=2)
    cuda_capability(A100)
    assert decode_config(128, CUDA, 1) == decode_config(128, CUDA, 2) == DecodeConfig()
    cuda_capability(ADA)
    assert decode_config(128, CUDA, 1) == decode_config(128, CUDA) == DecodeConfig(num_stages=2)
    cpu = torch.device("cpu")
    assert decode_config(128, cpu, 1) == decode_config(128, cpu) == DecodeConfig(block_n=32, min_split=64, num_stages=1)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
    """Plain attention of one query token over all keys. q: [H, D]; keys, values: [S, Hkv, D] -> [H, D]."""
    group = q.shape[0] // keys.shape[1]
    k, v = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    probs = torch.softmax(torch.einsum("hd,shd->hs", q, k) * scaling, -1)
    return torch.einsum("hs,shd->hd", probs, v)


@pytest.mark.parametrize("splits,counters", [(1, True), (3, True), (4, False), (9, True)],
                         ids=["1-split", "3-splits-merged-in-kernel", "4-splits-merge-kernel", "9-splits"])
def test_interpreted_fp8_decode_at_hoppers_settings_matches_the_dequantized_cache(cuda_capability, splits, counters):
    """The decode kernel over a shuffled FP8 pool with Hopper's 1-byte settings (64 keys a step in
    five stages, min_split 128) equals attention over the dequantized values, for lengths of 1, under, over and
    one past a multiple of 128. The scratch starts as NaN outputs with log-sum-exps of 100: a slice
    the merge reads but the first kernel never wrote (split geometry disagreeing between the two)
    shows up in the result."""
    _interpreted_triton()
    from backplane.plugins.attention_triton.configs import decode_config
    from backplane.plugins.attention_triton.decode_kernels import decode_attention

    cuda_capability(HOPPER)
    cfg = decode_config(HEAD_DIM, CUDA, 1)
    from helpers_kv import shuffled_fp8_pool

    gen = torch.Generator().manual_seed(splits)
    seq_lens = [1, 127, 300, 257, 129]
    k_buf, v_buf, req_to_token, rows = shuffled_fp8_pool(seq_lens, gen, KV_HEADS, HEAD_DIM, (K_SCALE, V_SCALE))
    bs = len(seq_lens)
    q = torch.randn(bs, HEADS, HEAD_DIM, generator=gen)
    logits = torch.full((bs, HEADS, splits, HEAD_DIM), float("nan"))
    lse = torch.full((bs, HEADS, splits), 100.0)
    merge_counters = torch.zeros(bs * KV_HEADS, dtype=torch.int32) if counters else None
    o = decode_attention(q, k_buf, v_buf, torch.empty_like(q), req_to_token, rows, torch.tensor(seq_lens), 0.2,
                         splits, attn_logits=logits, attn_lse=lse, config=cfg, merge_counters=merge_counters,
                         k_scale=K_SCALE, v_scale=V_SCALE)
    for b, n in enumerate(seq_lens):
        used = req_to_token[rows[b], :n].long()
        want = attend(q[b], dequantize_kv(k_buf[used], K_SCALE), dequantize_kv(v_buf[used], V_SCALE), 0.2)
        torch.testing.assert_close(o[b], want, atol=2e-4, rtol=2e-4, msg=f"request {b} of {n} keys")
    if merge_counters is not None:
        assert not merge_counters.any(), "a merge counter was left armed"


def test_triton_backend_over_fp8_takes_the_1_byte_settings(monkeypatch, cuda_capability):
    """Through the backend, decode and split verify ask decode_config for 1-byte K/V (and the split
    heuristic is told the pool's element size); with Hopper's answer (five stages) every mode
    over the FP8 pool equals torch_native over it."""
    from backplane.plugins.attention_triton.options import TritonAttentionOptions

    world = World([0, 5, 200], seed=4)
    triton_backend = _triton_backend(world.context("fp8", TritonAttentionOptions(verify_kernel="split")))
    from backplane.plugins.attention_triton import backend as backend_module
    from backplane.plugins.attention_triton import configs, decode_kernels, verify_kernels

    cuda_capability(HOPPER)
    asked, told = [], []

    def hopper_config(head_dim, device, kv_bytes=2):
        asked.append(kv_bytes)
        return configs.decode_config(head_dim, CUDA, kv_bytes)

    def choose_splits(*args, **kwargs):
        told.append(kwargs.get("kv_bytes"))
        return configs.choose_num_kv_splits(*args, **kwargs)

    for module in (decode_kernels, verify_kernels):
        monkeypatch.setattr(module, "decode_config", hopper_config)
    monkeypatch.setattr(backend_module, "choose_num_kv_splits", choose_splits)
    for _ in _every_step_matches_torch_native(world, triton_backend):
        pass
    assert asked == [1, 1], "decode and the split verify: the settings for 1-byte K/V"
    assert told and set(told) == {1}


class _Recorder:
    """A FlashInfer wrapper stand-in that records run()'s arguments and returns q (and a zero LSE)."""

    def __init__(self):
        self.calls = []

    def run(self, q, *args, return_lse=False, **kwargs):
        self.calls.append((args, kwargs))
        return (q.clone(), torch.zeros(q.shape[:2])) if return_lse else q.clone()


def test_flashinfer_glue_passes_the_scales_and_round_trips_the_new_tokens(monkeypatch):
    """CPU half of flashinfer over an FP8 pool (its kernels run in tests/gpu/test_fp8_kv_gpu.py):
    paged wrappers get the layer's k_scale / v_scale at run(), the ragged one the new tokens as the
    pool gives them back in q's dtype (and is planned for that dtype), a pool of the model's dtype
    gets the calls it always got, and the fused rotary + KV write is declined."""
    from backplane.plugins.attention_flashinfer import backend as fi_backend
    from backplane.plugins.attention_flashinfer import wrappers
    from backplane.plugins.attention_flashinfer.geometry import PAGED, RAGGED, RAGGED_PREFIX

    world = World([3], seed=3)
    pool = world.pools["fp8"]
    kv = fi_backend._kv_view(pool, LAYER.layer_id)
    assert (kv.k_scale, kv.v_scale) == (K_SCALE, V_SCALE)
    q = torch.randn(4, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    k, v = (torch.randn(4, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(2))
    cache = tuple(buf.unsqueeze(1) for buf in pool.get_kv_buffer(LAYER.layer_id))
    monkeypatch.setattr(wrappers, "merge_attention", lambda o_new, lse_new, o_old, lse_old: o_new)
    ragged, prefix, paged = _Recorder(), _Recorder(), _Recorder()
    wrappers.LayerRunner(RAGGED_PREFIX, (ragged, prefix))(q, k, v, cache, kv)
    wrappers.LayerRunner(PAGED, (paged,))(q, k, v, cache, kv)
    (new_k, new_v), _ = ragged.calls[0]
    want_k, want_v = pool.round_trip(LAYER.layer_id, k, v)
    assert new_k.dtype == torch.bfloat16 and torch.equal(new_k, want_k) and torch.equal(new_v, want_v)
    assert prefix.calls[0] == ((cache,), dict(k_scale=K_SCALE, v_scale=V_SCALE))
    assert paged.calls[0] == ((cache,), dict(k_scale=K_SCALE, v_scale=V_SCALE))
    plain = _Recorder()
    wrappers.LayerRunner(PAGED, (plain,))(q, k, v, cache)
    assert plain.calls[0] == ((cache,), {})
    dims = wrappers.Dims(HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16, FP8_E4M3)
    assert (dims.kv_dtype_of(RAGGED), dims.kv_dtype_of(PAGED)) == (torch.bfloat16, FP8_E4M3)
    batches = world.step(ForwardMode.DECODE, [1])
    ctx = world.context("fp8")
    backend = fi_backend.FlashInferAttnBackend(ctx)
    assert not backend.fuses_rotary_kv_write(batches["fp8"]) and backend.fuses_rotary_kv_write(batches["raw"])
    # decode over the FP8 pool plans the tensor-core kernel under auto (at a group of 4, where the
    # pool of the model's dtype keeps the CUDA-core one)
    assert HEADS // KV_HEADS <= 4
    assert backend.use_tensor_cores and backend._eager.use_tensor_cores
    assert not fi_backend.FlashInferAttnBackend(world.context("raw")).use_tensor_cores


def test_fused_rotary_kv_write_refuses_an_fp8_cache():
    from backplane.ops.native import rotary_kv_write

    cache = torch.zeros(4, 1, 8, dtype=FP8_E4M3)
    x = torch.randn(1, 1, 8)
    with pytest.raises(ValueError, match="^rotary_kv_write: expected a KV cache of a float dtype other than "
                                         "float8_e4m3fn, got torch.float8_e4m3fn"):
        rotary_kv_write(torch.zeros(1, dtype=torch.int64), x, x, x, torch.zeros(4, 8), True, cache, cache,
                        torch.tensor([1]))


# -- selection and the engine ------------------------------------------------------------------------


def test_selection_refuses_a_backend_without_fp8_in_one_line():
    registry = Registry()
    register = registry.callback("attention", "acme_attention", None)
    register(AttentionBackendSpec(name="acme", factory=object, description="t", priority=90))
    register(AttentionBackendSpec(name="acme_fp8", factory=object, description="t", kv_cache_dtypes=("fp8_e4m3",)))
    req = AttentionRequirements(platform="cpu", dtype="float32", head_dim=64, modes=("decode",),
                                kv_cache_dtype="fp8_e4m3")
    with pytest.raises(SelectionError) as err:
        select_attention_backend(registry, "acme", req)
    message = str(err.value)
    assert "\n" not in message
    assert message == ("--attention-backend acme (plugin 'acme_attention') cannot run here: KV cache dtype fp8_e4m3 "
                       "not served (serves: the model dtype. Fix: --kv-cache-dtype auto, or a backend declaring "
                       "kv_cache_dtypes fp8_e4m3). Usable here: acme_fp8")
    chosen = select_attention_backend(registry, "auto", req)
    assert chosen.spec.name == "acme_fp8" and "skipped acme (plugin 'acme_attention'): KV cache dtype" in chosen.reason
    auto_kv = AttentionRequirements(platform="cpu", dtype="float32", head_dim=64, modes=("decode",))
    assert select_attention_backend(registry, "auto", auto_kv).spec.name == "acme"


def test_engine_generates_over_an_fp8_pool_of_twice_the_tokens(monkeypatch):
    """tiny-llama in bf16 on CPU under a 1 MiB KV budget: fp8_e4m3 holds twice the tokens of auto,
    and the engine generates through torch_native over it."""
    from backplane import Engine, SamplingParams
    from backplane.executor import resources

    monkeypatch.setattr(resources, "CPU_KV_BUDGET_BYTES", 1 << 20)
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    slots = {}
    for kv_cache_dtype in ("auto", "fp8_e4m3"):
        engine = Engine("tiny-llama", device="cpu", dtype="bfloat16", attention_backend="torch_native",
                        kv_cache_dtype=kv_cache_dtype)
        pool = engine.runner.token_to_kv_pool
        slots[kv_cache_dtype] = pool.num_slots
        (out,) = engine.generate(input_ids=[[5, 17, 42, 9, 3]], sampling_params=params)
        assert len(out.token_ids) == 6
        assert pool.dtype == (FP8_E4M3 if kv_cache_dtype == "fp8_e4m3" else torch.bfloat16)
        engine.shutdown()
    assert slots["fp8_e4m3"] == 2 * slots["auto"]


def test_checkpoint_kv_scales_reach_the_pool_and_not_the_model(tmp_path):
    """A checkpoint's per-layer k_scale / v_scale tensors (compressed-tensors naming) are taken by the
    loader for the FP8 pool; strict weight loading never sees them."""
    from safetensors.torch import load_file, save_file

    from backplane import Engine, SamplingParams
    from helpers_models import make_hf_model, tiny_hf_config

    config = tiny_hf_config("LlamaForCausalLM")
    make_hf_model(config, seed=0).save_pretrained(tmp_path)
    scales = {f"model.layers.{i}.self_attn.{w}_scale": torch.tensor(0.5 + i + (w == "v") / 4)
              for i in range(config.num_hidden_layers) for w in "kv"}
    weights = load_file(str(tmp_path / "model.safetensors"))
    save_file({**weights, **scales}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    engine = Engine(str(tmp_path), device="cpu", kv_cache_dtype="fp8_e4m3")
    pool = engine.runner.token_to_kv_pool
    assert [pool.kv_scales(i) for i in range(config.num_hidden_layers)] == [
        (0.5 + i, 0.75 + i) for i in range(config.num_hidden_layers)]
    out = engine.generate(input_ids=[[3, 4, 5]], sampling_params=SamplingParams(max_new_tokens=3, temperature=0))
    assert out[0].error is None and len(out[0].token_ids) == 3
