"""The fused decode kernel (fused.py) under the interpreter: which path runs, what graphs re-plan,
the custom op, and the batch info's skipped copies."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere: run kernels on CPU

import pytest  # noqa: E402
import torch  # noqa: E402

from backplane.contracts.lora import LoraBackendContext  # noqa: E402
from backplane.contracts.lora_batch import LoraBatchInfo  # noqa: E402
from backplane.lora.torch_native import TorchNativeLoraBackend  # noqa: E402

K, OFFSETS = 40, [0, 48, 64, 80]  # q, k, v widths 48, 16, 16
RANKS, SCALINGS = [0, 8, 32, 16], [0.0, 1.5, 0.5, 2.0]
R_MAX, NUM_SLOTS = 32, 4


def make_ctx(max_tokens: int = 80) -> LoraBackendContext:
    return LoraBackendContext(device=torch.device("cpu"), dtype=torch.float32, max_loras_per_batch=NUM_SLOTS - 1,
                              max_lora_rank=R_MAX, max_bs=max_tokens, max_num_tokens=max_tokens)


def make_weights(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(NUM_SLOTS, 3 * R_MAX, K, generator=gen) / K**0.5
    rows = torch.arange(3 * R_MAX) % R_MAX
    a *= (rows[None, :] < torch.tensor(RANKS)[:, None]).float()[:, :, None]
    b = torch.randn(NUM_SLOTS, OFFSETS[-1], R_MAX, generator=gen) / R_MAX**0.5
    b[0] = 0
    return a, b


def decode_info(slots: list[int], max_segments: int | None = None) -> LoraBatchInfo:
    return LoraBatchInfo.from_segments([1] * len(slots), slots, RANKS, SCALINGS, "cpu", max_segments)


def expected(info, x, a, b, base):
    native = TorchNativeLoraBackend(make_ctx())
    native.prepare_batch(info)
    return native.apply_lora(x, a, b, OFFSETS, base.clone())


def triton_backend(**tuning):
    from backplane.plugins.lora_triton.backend import TritonLoraBackend, Tuning

    return TritonLoraBackend(make_ctx(), Tuning(**tuning))


def count_calls(monkeypatch, module, name: str) -> list:
    calls = []
    original = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: (calls.append(1), original(*a, **k))[1])
    return calls


@pytest.mark.parametrize("num_tokens", [1, 17, 64, 65])
def test_fused_path_up_to_the_threshold(monkeypatch, num_tokens):
    from backplane.plugins.lora_triton import fused, kernels

    fused_calls = count_calls(monkeypatch, fused, "launch")
    shrink_calls = count_calls(monkeypatch, kernels, "shrink")
    slots = [(3 * t) % NUM_SLOTS for t in range(num_tokens)]
    info = decode_info(slots)
    a, b = make_weights()
    x, base = torch.randn(num_tokens, K), torch.randn(num_tokens, OFFSETS[-1])
    backend = triton_backend()
    backend.prepare_batch(info)
    got = backend.apply_lora(x, a, b, OFFSETS, base.clone())
    torch.testing.assert_close(got, expected(info, x, a, b, base), atol=1e-4, rtol=1e-4)
    fuses = num_tokens <= fused.FUSED_MAX_TOKENS
    assert (len(fused_calls), len(shrink_calls)) == ((1, 0) if fuses else (0, 1))
    assert backend._planned is not fuses  # no host tile plan for a fused batch


@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_fused_kernel_splits_k_into_a_strided_output(split_k):
    """out is a column slice of a wider buffer (as a fused output may be); K split among programs
    whose last one expands; the locks are re-armed, so a second launch adds the delta again."""
    from backplane.plugins.lora_triton.fused import FusedBuffers, FusedConfig, launch

    info = decode_info([1, 2, 0, 3, 2])
    a, b = make_weights(1)
    x, wide = torch.randn(5, K), torch.randn(5, OFFSETS[-1] + 24)
    before = wide.clone()
    base = wide[:, 8 : 8 + OFFSETS[-1]]
    once = expected(info, x, a, b, base)
    buffers = FusedBuffers.allocate(torch.device("cpu"), NUM_SLOTS, R_MAX)
    config = FusedConfig(span=128, split_k=split_k)
    launch(x, a, b, base, info.token_slots, info.ranks, info.scalings, OFFSETS, buffers, config)
    torch.testing.assert_close(base, once, atol=1e-4, rtol=1e-4)
    assert not buffers.locks.any()
    launch(x, a, b, base, info.token_slots, info.ranks, info.scalings, OFFSETS, buffers, config)
    torch.testing.assert_close(base - once, once - before[:, 8 : 8 + OFFSETS[-1]], atol=1e-4, rtol=1e-4)
    outside = [*range(8), *range(8 + OFFSETS[-1], wide.shape[1])]
    assert torch.equal(wide[:, outside], before[:, outside])
    assert torch.equal(base[2], before[2, 8 : 8 + OFFSETS[-1]])  # token 2 is base only


def test_split_layout_model():
    """A wide K splits and a wide output gets wider spans; never more programs than the buffers hold."""
    from backplane.plugins.lora_triton.fused import MAX_GROUPS, choose_split

    span, split_k = choose_split(8192, (2048,), 16, 2, 8)
    assert split_k > 1 and 8192 // split_k >= 256
    assert choose_split(72, (80, 40, 40), 16, 4, 4)[1] == 1  # too little K to split
    for widths in [(2048, 512, 512), (8192, 8192), (1 << 20,)]:
        span, split_k = choose_split(2048, widths, 64, 2, 8)
        assert split_k * sum(-(-w // span) for w in widths) <= MAX_GROUPS


def test_graph_replay_plans_only_when_the_capture_used_separate_products(monkeypatch):
    from backplane.plugins.lora_triton import plan

    updates = count_calls(monkeypatch, plan.TilePlan, "update_")
    a, b = make_weights()
    backend = triton_backend()
    backend.init_graph_state(8, 8)
    info = decode_info([0] * 8, max_segments=8)
    backend.init_metadata_for_capture("fused-key", info)
    x, base = torch.randn(8, K), torch.randn(8, OFFSETS[-1])
    backend.apply_lora(x, a, b, OFFSETS, base.clone())  # the "captured" body: fused only
    backend.init_metadata_for_capture("split-key", info)
    backend.lora_a(x, a, 3)  # this graph's body runs the separate products
    assert len(updates) == 2  # a capture always plans
    slots = [1, 2, 3, 0, 2, 1, 1, 3]
    info.update_([1] * 8, slots)
    backend.init_metadata_for_replay("fused-key", info)
    assert len(updates) == 2, "a fused graph's replay must not plan on the host"
    got = backend.apply_lora(x, a, b, OFFSETS, base.clone())
    torch.testing.assert_close(got, expected(info, x, a, b, base), atol=1e-4, rtol=1e-4)
    backend.init_metadata_for_replay("split-key", info)
    assert len(updates) == 3


def test_separate_products_after_a_fused_prepare_plan_late():
    a, b = make_weights()
    info = decode_info([2, 1, 0, 3])
    backend = triton_backend()
    backend.prepare_batch(info)
    x, base = torch.randn(4, K), torch.randn(4, OFFSETS[-1])
    got = backend.qkv_lora_b(backend.lora_a(x, a, 3), b, OFFSETS, base.clone())
    torch.testing.assert_close(got, expected(info, x, a, b, base), atol=1e-4, rtol=1e-4)


def test_fused_rejects_bad_shapes_before_launch():
    a, b = make_weights()
    backend = triton_backend()
    backend.prepare_batch(decode_info([1, 2]))
    with pytest.raises(ValueError, match="apply_lora: expected x"):
        backend.apply_lora(torch.randn(2, K + 1), a, b, OFFSETS, torch.zeros(2, OFFSETS[-1]))
    with pytest.raises(ValueError, match="output_offsets"):
        backend.apply_lora(torch.randn(2, K), a, b, [0, 48, 64, 81], torch.zeros(2, OFFSETS[-1]))


def test_custom_op_is_registered_with_a_fake():
    from backplane.plugins.lora_triton import fused  # registers the op

    info = decode_info([1, 3, 2])
    a, b = make_weights()
    buffers = fused.FusedBuffers.allocate(torch.device("cpu"), NUM_SLOTS, R_MAX)
    args = (torch.randn(3, K), a, b, torch.randn(3, OFFSETS[-1]), info.token_slots, info.ranks, info.scalings,
            buffers.ws, buffers.locks, OFFSETS, [128, 2, 0, 3])
    op = torch.ops.backplane_lora_triton.fused_shrink_expand.default
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    out = args[3].clone()
    want = expected(info, args[0], a, b, out)
    op(*args[:3], out, *args[4:])
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)


def test_batch_info_copies_only_when_the_segments_change():
    info = LoraBatchInfo.allocate(6, NUM_SLOTS, "cpu", max_tokens=12)
    info.update_([2, 1, 3], [1, 0, 2])
    assert info.num_device_copies == 1
    assert info.token_slots.tolist() == [1, 1, 0, 2, 2, 2] + [0] * 6
    info.update_([2, 1, 3], [1, 0, 2])  # the same decode step again: nothing copied
    info.update_(torch.tensor([2, 1, 3]), torch.tensor([1, 0, 2]))
    assert info.num_device_copies == 1
    info.update_([1, 1], [3, 1])  # fewer tokens: the old tail is zeroed
    assert info.num_device_copies == 2
    assert info.token_slots.tolist() == [3, 1] + [0] * 10
    assert info.seg_indptr[:4].tolist() == [0, 1, 2, 2] and info.num_tokens == 2
    with pytest.raises(ValueError, match="at most 12 tokens"):
        info.update_([7, 6], [1, 1])
    assert info.token_slots.tolist() == [3, 1] + [0] * 10  # a refused batch changes nothing


def test_apply_lora_compiles_to_the_custom_op():
    """torch.compile traces apply_lora whole (fullgraph: the Triton launch is behind the op)."""
    info = decode_info([1, 2, 0, 3, 1])
    a, b = make_weights(2)
    backend = triton_backend()
    backend.prepare_batch(info)
    x, w = torch.randn(5, K), torch.randn(OFFSETS[-1], K)

    def projection(x):
        return backend.apply_lora(x, a, b, OFFSETS, x @ w.T)

    compiled = torch.compile(projection, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), expected(info, x, a, b, x @ w.T), atol=1e-4, rtol=1e-4)
