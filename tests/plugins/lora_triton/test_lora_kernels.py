"""LoRA arithmetic: torch_native and the Triton kernels (under the interpreter) against a per-token reference."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere: run kernels on CPU

import random  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from backplane.contracts.lora import LoraBackendContext, host_offsets  # noqa: E402
from backplane.contracts.lora_batch import LoraBatchInfo  # noqa: E402
from backplane.lora.torch_native import SPEC as TORCH_NATIVE_SPEC  # noqa: E402
from backplane.lora.torch_native import TorchNativeLoraBackend  # noqa: E402

R_MAX = 16
RANKS = [0, 4, 8, 16]  # slot 0 is the base-only slot
SCALINGS = [0.0, 2.0, 0.5, 1.25]
NUM_SLOTS = len(RANKS)
MAX_SEGMENTS = 8
TOL = {torch.float32: 1e-4, torch.float16: 2e-2}


@dataclass
class Batch:
    seg_lens: list[int]
    slots: list[int]

    @property
    def token_slots(self) -> list[int]:
        return [slot for length, slot in zip(self.seg_lens, self.slots) for _ in range(length)]


# slot 2 appears twice, apart; slot 0 (base only) in the middle; lengths 1, 3, 17, 33
BATCH = Batch(seg_lens=[1, 3, 17, 33, 2, 5], slots=[2, 0, 1, 3, 2, 1])
# all MAX_SEGMENTS segments in use, the last one with an adapter
OTHER_BATCH = Batch(seg_lens=[33, 1, 2, 3, 1, 4, 3, 1], slots=[1, 3, 3, 0, 2, 1, 2, 3])
NUM_ROWS = 64  # > any batch's tokens: trailing rows are not covered by a segment


def make_ctx(dtype=torch.float32) -> LoraBackendContext:
    return LoraBackendContext(
        device=torch.device("cpu"), dtype=dtype, max_loras_per_batch=NUM_SLOTS - 1,
        max_lora_rank=R_MAX, max_bs=MAX_SEGMENTS, max_num_tokens=NUM_ROWS,
    )  # fmt: skip


def make_info(batch: Batch = BATCH) -> LoraBatchInfo:
    return LoraBatchInfo.from_segments(batch.seg_lens, batch.slots, RANKS, SCALINGS, "cpu", MAX_SEGMENTS)


def make_backend(name: str, **kwargs):
    if name == "torch_native":
        return TorchNativeLoraBackend(make_ctx(), **kwargs)
    if name == "torch_native_graph":  # the slot-loop path used inside CUDA graph captures
        return TorchNativeLoraBackend(make_ctx(), graph_safe=True)
    from backplane.plugins.lora_triton.backend import TritonLoraBackend, Tuning

    return TritonLoraBackend(make_ctx(), Tuning(**kwargs))


def weights(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Per-slot weights [num_slots, rows, cols]; slot 0 is zero, other slots random everywhere
    (also in the padding beyond the rank, which every backend must ignore)."""
    w = torch.randn(NUM_SLOTS, rows, cols) / cols**0.5
    w[0] = 0
    return w.to(dtype)


# ---- the plain reference: one token at a time, in float64 -----------------------------------
def ref_shrink(x, a, batch: Batch, num_slices: int) -> torch.Tensor:
    y = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float64)
    for t, slot in enumerate(batch.token_slots):
        cols = [c for c in range(a.shape[1]) if c % R_MAX < RANKS[slot]]
        y[t, cols] = a[slot, cols].double() @ x[t].double()
    return y


def ref_expand(x, b, base, batch: Batch, offsets) -> torch.Tensor:
    out = base.double().clone()
    for t, slot in enumerate(batch.token_slots):
        rank = RANKS[slot]
        for j, (lo, hi) in enumerate(zip(offsets, offsets[1:])):
            x_j = x[t, j * R_MAX : j * R_MAX + rank].double()
            out[t, lo:hi] += SCALINGS[slot] * (b[slot, lo:hi, :rank].double() @ x_j)
    return out


def assert_close(actual, expected, dtype):
    tol = TOL[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), atol=tol, rtol=tol)


BACKENDS = ["torch_native", "torch_native_graph", "triton"]
DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("num_slices", [1, 3])
def test_lora_a(backend_name, dtype, num_slices):
    k = 72
    x = torch.randn(NUM_ROWS, k).to(dtype)
    a = weights(num_slices * R_MAX, k, dtype)
    backend = make_backend(backend_name)
    backend.prepare_batch(make_info())
    y = backend.lora_a(x, a, num_slices)
    assert y.shape == (NUM_ROWS, num_slices * R_MAX)
    covered = sum(BATCH.seg_lens)
    assert_close(y[:covered], ref_shrink(x, a, BATCH, num_slices)[:covered], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_lora_b(backend_name, dtype):
    n = 100
    x, b = torch.randn(NUM_ROWS, R_MAX).to(dtype), weights(n, R_MAX, dtype)
    base = torch.randn(NUM_ROWS, n).to(dtype)
    backend = make_backend(backend_name)
    backend.prepare_batch(make_info())
    out = backend.lora_b(x, b, base.clone())
    assert_close(out, ref_expand(x, b, base, BATCH, (0, n)), dtype)  # uncovered rows untouched too


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_qkv_lora_b(backend_name, dtype):
    n_q, n_kv = 80, 40  # slice boundaries that are not multiples of any block
    offsets = (0, n_q, n_q + n_kv, n_q + 2 * n_kv)
    x, b = torch.randn(NUM_ROWS, 3 * R_MAX).to(dtype), weights(offsets[-1], R_MAX, dtype)
    base = torch.randn(NUM_ROWS, offsets[-1]).to(dtype)
    backend = make_backend(backend_name)
    backend.prepare_batch(make_info())
    out = backend.qkv_lora_b(x, b, list(offsets), base.clone())
    assert_close(out, ref_expand(x, b, base, BATCH, offsets), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_gate_up_lora_b(backend_name, dtype):
    n_inter = 72
    x, b = torch.randn(NUM_ROWS, 2 * R_MAX).to(dtype), weights(2 * n_inter, R_MAX, dtype)
    base = torch.randn(NUM_ROWS, 2 * n_inter).to(dtype)
    backend = make_backend(backend_name)
    backend.prepare_batch(make_info())
    out = backend.gate_up_lora_b(x, b, base.clone())
    assert_close(out, ref_expand(x, b, base, BATCH, (0, n_inter, 2 * n_inter)), dtype)


def run_qkv(backend, info, x, a, b, offsets, base):
    """One fused q,k,v LoRA: shrink with the stacked A, then the fused expand."""
    backend.prepare_batch(info)
    return backend.qkv_lora_b(backend.lora_a(x, a, 3), b, offsets, base.clone())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "tuning",
    [{}, {"shrink_split_k": 3, "shrink_block_k": 16}, {"block_m": 32, "expand_block_n": 32}],
    ids=["auto", "split_k", "block_m32"],
)
def test_triton_equals_torch_native(dtype, tuning):
    k, offsets = 96, (0, 64, 96, 128)
    x, a, b = torch.randn(NUM_ROWS, k).to(dtype), weights(3 * R_MAX, k, dtype), weights(128, R_MAX, dtype)
    base = torch.randn(NUM_ROWS, 128).to(dtype)
    expected = run_qkv(make_backend("torch_native"), make_info(), x, a, b, offsets, base)
    actual = run_qkv(make_backend("triton", **tuning), make_info(), x, a, b, offsets, base)
    assert_close(actual, expected, dtype)


def test_split_k_locks_rearm_between_launches():
    k = 96
    x, a = torch.randn(NUM_ROWS, k), weights(3 * R_MAX, k, torch.float32)
    backend = make_backend("triton", shrink_split_k=3, shrink_block_k=16)
    backend.prepare_batch(make_info())
    expected = ref_shrink(x, a, BATCH, 3)[:61]
    for _ in range(2):  # the second launch finds the locks the first one used
        assert_close(backend.lora_a(x, a, 3)[:61], expected, torch.float32)
        assert not backend._plan.locks.any()


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_update_in_place_equals_fresh(backend_name):
    k, offsets = 64, (0, 48, 64, 80)
    x, a, b = torch.randn(NUM_ROWS, k), weights(3 * R_MAX, k, torch.float32), weights(80, R_MAX, torch.float32)
    base = torch.randn(NUM_ROWS, 80)
    info, backend = make_info(BATCH), make_backend(backend_name)
    run_qkv(backend, info, x, a, b, offsets, base)
    pointers = info.seg_lens.data_ptr(), info.weight_indices.data_ptr(), info.ranks.data_ptr()
    info.update_(OTHER_BATCH.seg_lens, OTHER_BATCH.slots)
    assert (info.seg_lens.data_ptr(), info.weight_indices.data_ptr(), info.ranks.data_ptr()) == pointers
    reused = run_qkv(backend, info, x, a, b, offsets, base)
    fresh = run_qkv(make_backend(backend_name), make_info(OTHER_BATCH), x, a, b, offsets, base)
    torch.testing.assert_close(reused, fresh)
    assert_close(reused, ref_expand(ref_shrink(x, a, OTHER_BATCH, 3), b, base, OTHER_BATCH, offsets), torch.float32)


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_graph_metadata_replay_path(backend_name):
    """Capture-time planning for one batch, replay-time planning for another, same launch bounds."""
    k, n = 64, 48
    x, a, b = torch.randn(NUM_ROWS, k), weights(R_MAX, k, torch.float32), weights(n, R_MAX, torch.float32)
    base = torch.randn(NUM_ROWS, n)
    backend, info = make_backend(backend_name), make_info(BATCH)
    backend.init_graph_state(MAX_SEGMENTS, NUM_ROWS)
    backend.init_metadata_for_capture("decode-64", info)
    backend.lora_b(backend.lora_a(x, a), b, base.clone())
    info.update_(OTHER_BATCH.seg_lens, OTHER_BATCH.slots)
    backend.init_metadata_for_replay("decode-64", info)
    out = backend.lora_b(backend.lora_a(x, a), b, base.clone())
    expected = ref_expand(ref_shrink(x, a, OTHER_BATCH, 1), b, base, OTHER_BATCH, (0, n))
    assert_close(out, expected, torch.float32)


def test_base_only_batch_leaves_output_unchanged():
    x, a, b = torch.randn(20, 64), weights(R_MAX, 64, torch.float32), weights(48, R_MAX, torch.float32)
    base = torch.randn(20, 48)
    backend = make_backend("triton")
    backend.prepare_batch(make_info(Batch(seg_lens=[7, 13], slots=[0, 0])))
    y = backend.lora_a(x, a)
    assert torch.equal(y, torch.zeros_like(y))
    assert torch.equal(backend.lora_b(y, b, base.clone()), base)


def test_tile_plan_groups_tokens_by_slot():
    from backplane.plugins.lora_triton.plan import max_tiles, plan_tiles

    rng = random.Random(0)
    for _ in range(200):
        num_segments = rng.randint(1, MAX_SEGMENTS)
        seg_lens = [rng.randint(0, 40) for _ in range(num_segments)]
        batch = Batch(seg_lens, [rng.randrange(NUM_SLOTS) for _ in range(num_segments)])
        block_m = rng.choice([16, 32, 64])
        tiles, perm = plan_tiles(make_info(batch), block_m)
        num_tokens = sum(batch.seg_lens)
        assert sorted(perm.tolist()) == list(range(num_tokens))
        assert len(tiles) // 3 <= max_tiles(num_tokens, NUM_SLOTS, block_m)
        covered = []
        for slot, start, length in zip(tiles[0::3], tiles[1::3], tiles[2::3]):
            assert 0 < length <= block_m
            rows = perm[start : start + length].tolist()
            assert {batch.token_slots[t] for t in rows} == {slot}
            covered += rows
        assert sorted(covered) == list(range(num_tokens))


def test_batch_info_buffers_and_errors():
    info = make_info()
    assert info.bs == 6 and info.num_tokens == 61 and info.max_len == 33
    assert info.seg_lens.tolist() == BATCH.seg_lens + [0, 0]
    assert info.seg_indptr.tolist() == [0, 1, 4, 21, 54, 56, 61, 61, 61]
    assert info.weight_indices.tolist() == BATCH.slots + [0, 0]
    with pytest.raises(ValueError, match="expected at most 8 segments"):
        info.update_([1] * 9, [0] * 9)
    with pytest.raises(ValueError, match=r"expected weight indices in \[0, 4\)"):
        info.update_([1, 2], [0, 4])
    with pytest.raises(ValueError, match="expected ranks for 4 slots"):
        info.set_slots_(ranks=[0, 4])
    with pytest.raises(ValueError, match="output_offsets: expected 4 increasing ints from 0 to 96"):
        host_offsets([0, 64, 80], num_slices=3, width=96)


def test_triton_rejects_bad_shapes_before_launch():
    backend = make_backend("triton")
    backend.prepare_batch(make_info())
    with pytest.raises(ValueError, match="expected a_weights"):
        backend.lora_a(torch.randn(NUM_ROWS, 64), weights(R_MAX, 72, torch.float32))
    with pytest.raises(ValueError, match="expected x with between 61"):
        backend.lora_a(torch.randn(32, 64), weights(R_MAX, 64, torch.float32))


def test_specs_register():
    from backplane.plugins import lora_triton

    specs = []
    lora_triton.backplane_register_lora_backends(register=specs.append)
    (spec,) = specs
    # interpreted kernels register below torch_native so that `auto` never picks them
    assert (spec.name, spec.supports_graph, spec.priority) == ("triton", True, -50)
    assert spec.platforms == ("cpu", "cuda") and "bfloat16" not in spec.dtypes  # interpreted
    assert spec.available() is None
    assert isinstance(spec.factory(make_ctx()), type(make_backend("triton")))
    assert TORCH_NATIVE_SPEC.name == "torch_native" and TORCH_NATIVE_SPEC.supports_graph
    assert isinstance(TORCH_NATIVE_SPEC.factory(make_ctx()), TorchNativeLoraBackend)
