"""Triton LoRA kernels on the GPU: bf16 against a float32 reference, and CUDA-graph replay with
batch info updated in place equal to an eager run."""

from __future__ import annotations

import random

import pytest
import torch

from backplane.contracts.lora import LoraBackendContext
from backplane.contracts.lora_batch import LoraBatchInfo
from backplane.lora.torch_native import TorchNativeLoraBackend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

R_MAX = 16
NUM_SLOTS = 9  # slot 0 base only + 8 adapters
HIDDEN, N_Q, N_KV, N_INTER = 1024, 1024, 256, 1536
QKV_OFFSETS = (0, N_Q, N_Q + N_KV, N_Q + 2 * N_KV)
MAX_SEGMENTS, MAX_TOKENS = 64, 512


def slot_table(seed: int) -> tuple[list[int], list[float]]:
    rng = random.Random(seed)
    ranks = [0] + [rng.choice([4, 8, 16]) for _ in range(NUM_SLOTS - 1)]
    scalings = [0.0] + [rng.uniform(0.25, 2.0) for _ in range(NUM_SLOTS - 1)]
    return ranks, scalings


def decode_batch(num_requests: int, seed: int) -> tuple[list[int], list[int]]:
    """One token per request, adapters interleaved (slot 0 included), segments of length 1."""
    rng = random.Random(seed)
    return [1] * num_requests, [rng.randrange(NUM_SLOTS) for _ in range(num_requests)]


PREFILL_BATCH = ([1, 3, 17, 33, 200, 77, 5], [2, 0, 5, 2, 8, 1, 5])


def make_ctx() -> LoraBackendContext:
    return LoraBackendContext(
        device=torch.device("cuda"), dtype=torch.bfloat16, max_loras_per_batch=NUM_SLOTS - 1,
        max_lora_rank=R_MAX, max_bs=MAX_SEGMENTS, max_num_tokens=MAX_TOKENS,
    )  # fmt: skip


def triton_backend():
    from backplane.plugins.lora_triton.backend import TritonLoraBackend

    return TritonLoraBackend(make_ctx())


def make_info(seg_lens, slots, seed=0) -> LoraBatchInfo:
    ranks, scalings = slot_table(seed)
    return LoraBatchInfo.from_segments(seg_lens, slots, ranks, scalings, "cuda", MAX_SEGMENTS)


def weights(rows: int, cols: int) -> torch.Tensor:
    """[num_slots, rows, cols] bf16; slot 0 zero; padding beyond the rank random (must be ignored)."""
    w = torch.randn(NUM_SLOTS, rows, cols, device="cuda") / cols**0.5
    w[0] = 0
    return w.to(torch.bfloat16)


def layer_weights() -> dict[str, torch.Tensor]:
    return {
        "qkv_a": weights(3 * R_MAX, HIDDEN), "qkv_b": weights(QKV_OFFSETS[-1], R_MAX),
        "gate_up_a": weights(2 * R_MAX, HIDDEN), "gate_up_b": weights(2 * N_INTER, R_MAX),
        "down_a": weights(R_MAX, N_INTER), "down_b": weights(HIDDEN, R_MAX),
    }  # fmt: skip


def run_layer(backend, w, x, x_inter, outs) -> None:
    """The fused q,k,v, the fused gate,up and the down LoRA of one layer, into outs (in place)."""
    backend.qkv_lora_b(backend.lora_a(x, w["qkv_a"], 3), w["qkv_b"], QKV_OFFSETS, outs["qkv"])
    backend.gate_up_lora_b(backend.lora_a(x, w["gate_up_a"], 2), w["gate_up_b"], outs["gate_up"])
    backend.lora_b(backend.lora_a(x_inter, w["down_a"]), w["down_b"], outs["down"])


# ---- float32 reference, vectorised over tokens ---------------------------------------------------
def ref_lora(x, a, b, base, info: LoraBatchInfo, offsets) -> torch.Tensor:
    """base + scaling * ((x A^T) rounded to bf16) B^T per token, rank-masked, in float32."""
    num_tokens = info.num_tokens
    token_slots = torch.repeat_interleave(info.weight_indices[: info.bs].long(), info.seg_lens[: info.bs].long())
    ranks = info.ranks.long()[token_slots]  # [T]
    num_slices = len(offsets) - 1
    columns = torch.arange(num_slices * R_MAX, device="cuda") % R_MAX
    keep = (columns[None, :] < ranks[:, None]).float()  # [T, num_slices * R_max]
    y = torch.einsum("tk,trk->tr", x[:num_tokens].float(), a[token_slots].float()) * keep
    y = y.to(torch.bfloat16).float()
    out = base.float().clone()
    for j, (lo, hi) in enumerate(zip(offsets, offsets[1:])):
        y_j = y[:, j * R_MAX : (j + 1) * R_MAX]
        delta = torch.einsum("tr,tnr->tn", y_j, b[token_slots, lo:hi].float())
        out[:num_tokens, lo:hi] += info.scalings[token_slots, None] * delta
    return out


def ref_layer(w, x, x_inter, outs, info) -> dict[str, torch.Tensor]:
    return {
        "qkv": ref_lora(x, w["qkv_a"], w["qkv_b"], outs["qkv"], info, QKV_OFFSETS),
        "gate_up": ref_lora(x, w["gate_up_a"], w["gate_up_b"], outs["gate_up"], info, (0, N_INTER, 2 * N_INTER)),
        "down": ref_lora(x_inter, w["down_a"], w["down_b"], outs["down"], info, (0, HIDDEN)),
    }


def random_inputs(num_rows: int):
    x = torch.randn(num_rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    x_inter = torch.randn(num_rows, N_INTER, device="cuda", dtype=torch.bfloat16)
    outs = {
        "qkv": torch.randn(num_rows, QKV_OFFSETS[-1], device="cuda", dtype=torch.bfloat16),
        "gate_up": torch.randn(num_rows, 2 * N_INTER, device="cuda", dtype=torch.bfloat16),
        "down": torch.randn(num_rows, HIDDEN, device="cuda", dtype=torch.bfloat16),
    }
    return x, x_inter, outs


def assert_layer_close(actual, expected, atol=3e-2, rtol=2e-2):
    for name in expected:
        torch.testing.assert_close(actual[name].float(), expected[name].float(), atol=atol, rtol=rtol, msg=name)


@pytest.mark.parametrize(
    "seg_lens,slots", [decode_batch(1, 1), decode_batch(17, 2), decode_batch(64, 3), PREFILL_BATCH],
    ids=["decode1", "decode17", "decode64", "prefill"],
)  # fmt: skip
def test_triton_bf16_matches_reference(seg_lens, slots):
    torch.manual_seed(0)
    info, w = make_info(seg_lens, slots), layer_weights()
    x, x_inter, outs = random_inputs(info.num_tokens + 3)  # 3 uncovered rows stay untouched
    expected = ref_layer(w, x, x_inter, outs, info)
    backend = triton_backend()
    backend.prepare_batch(info)
    run_layer(backend, w, x, x_inter, outs)
    assert_layer_close(outs, expected)


def test_triton_equals_torch_native_bf16():
    torch.manual_seed(1)
    info, w = make_info(*PREFILL_BATCH), layer_weights()
    x, x_inter, outs = random_inputs(info.num_tokens)
    native_outs = {name: t.clone() for name, t in outs.items()}
    native = TorchNativeLoraBackend(make_ctx())
    native.prepare_batch(info)
    run_layer(native, w, x, x_inter, native_outs)
    backend = triton_backend()
    backend.prepare_batch(info)
    run_layer(backend, w, x, x_inter, outs)
    assert_layer_close(outs, native_outs)


@pytest.mark.parametrize("backend_name", ["triton", "torch_native"])
def test_cuda_graph_replay_with_updated_batch_info(backend_name):
    """Capture with one batch, update the batch info in place (other lengths, slots, segment count),
    replay, and compare with an eager run of a fresh backend on the new batch."""
    torch.manual_seed(2)
    num_rows = 48
    w = layer_weights()
    x, x_inter, base = random_inputs(num_rows)
    info = make_info(*decode_batch(num_rows, 4))
    backend = triton_backend() if backend_name == "triton" else TorchNativeLoraBackend(make_ctx())
    backend.init_graph_state(MAX_SEGMENTS, MAX_TOKENS)
    key = ("decode", num_rows, True)
    backend.init_metadata_for_capture(key, info)
    static_outs = {name: t.clone() for name, t in base.items()}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles the kernels) outside the capture
        run_layer(backend, w, x, x_inter, {name: t.clone() for name, t in base.items()})
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_layer(backend, w, x, x_inter, static_outs)

    for seg_lens, slots in [([5, 1, 30, 12], [3, 0, 7, 3]), ([1] * 40, decode_batch(40, 5)[1]), ([48], [6])]:
        info.update_(seg_lens, slots)
        backend.init_metadata_for_replay(key, info)
        for name, t in static_outs.items():
            t.copy_(base[name])
        graph.replay()
        eager_outs = {name: t.clone() for name, t in base.items()}
        fresh = triton_backend() if backend_name == "triton" else TorchNativeLoraBackend(make_ctx())
        fresh.prepare_batch(make_info(seg_lens, slots))
        run_layer(fresh, w, x, x_inter, eager_outs)
        torch.cuda.synchronize()
        assert_layer_close(static_outs, eager_outs, atol=1e-2, rtol=1e-2)
        assert_layer_close(static_outs, ref_layer(w, x, x_inter, base, info))


def run_layer_fused(backend, w, x, x_inter, outs) -> None:
    """The same three projections through apply_lora (one fused launch each for decode sizes)."""
    backend.apply_lora(x, w["qkv_a"], w["qkv_b"], QKV_OFFSETS, outs["qkv"])
    backend.apply_lora(x, w["gate_up_a"], w["gate_up_b"], (0, N_INTER, 2 * N_INTER), outs["gate_up"])
    backend.apply_lora(x_inter, w["down_a"], w["down_b"], (0, HIDDEN), outs["down"])


@pytest.mark.parametrize("num_rows", [1, 17, 64])
def test_fused_decode_graph_replays_updated_batches(num_rows):
    """The fused kernel (K split among programs at these widths) captured once, replayed on batches
    refreshed in place: equal to the float32 reference, with no tile plan and the locks re-armed."""
    from backplane.plugins.lora_triton.fused import choose_split

    assert choose_split(HIDDEN, (N_Q, N_KV, N_KV), 16, 2, NUM_SLOTS - 1)[1] > 1  # the split path runs
    torch.manual_seed(3)
    w = layer_weights()
    x, x_inter, base = random_inputs(num_rows)
    info = make_info(*decode_batch(num_rows, 11))
    backend = triton_backend()
    backend.init_graph_state(MAX_SEGMENTS, MAX_TOKENS)
    key = ("decode", num_rows, True)
    backend.init_metadata_for_capture(key, info)
    static_outs = {name: t.clone() for name, t in base.items()}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up: compiles, allocates the fused kernel's buffers
        run_layer_fused(backend, w, x, x_inter, {name: t.clone() for name, t in base.items()})
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_layer_fused(backend, w, x, x_inter, static_outs)
    for seed in (12, 13, 14):
        info.update_(*decode_batch(num_rows, seed))
        backend.init_metadata_for_replay(key, info)
        assert not backend._planned and key not in backend._split_keys
        for name, t in static_outs.items():
            t.copy_(base[name])
        graph.replay()
        torch.cuda.synchronize()
        assert_layer_close(static_outs, ref_layer(w, x, x_inter, base, info))
        assert not backend._fused_buffers[-1].locks.any()
