"""The shrink folded into the base GEMM (`--triton-lora.decode-path folded`), on CPU.

1. The expand kernel (folded.py, under the interpreter) and the contract's torch reference
   (LoraBackend.expand_folded) both give the unfolded LoRA output (torch_native's apply_lora).
2. The core's folded layer: [W; A] is one buffer whose views the base layer and load_slot write, a
   LoRA pass of a decode-sized batch takes one GEMM and one expand, and every output equals the
   unfolded layer's (q/k/v, gate/up, a single projection, with a bias, base-only and mixed slots).
"""

import contextlib
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere: run kernels on CPU

import pytest  # noqa: E402
import torch  # noqa: E402

from backplane.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear  # noqa: E402
from backplane.contracts.forward_context import ForwardContext, ForwardSlot  # noqa: E402
from backplane.contracts.lora import LoraBackendContext  # noqa: E402
from backplane.contracts.lora_batch import LoraBatchInfo  # noqa: E402
from backplane.lora.layers import LoraRuntime, wrap_model  # noqa: E402
from backplane.lora.torch_native import TorchNativeLoraBackend  # noqa: E402

K, R_MAX, NUM_SLOTS = 40, 16, 4
RANKS, SCALINGS = [0, 8, 16, 4], [0.0, 1.5, 0.5, 2.0]


def make_ctx(options=None) -> LoraBackendContext:
    return LoraBackendContext(device=torch.device("cpu"), dtype=torch.float32, max_loras_per_batch=NUM_SLOTS - 1,
                              max_lora_rank=R_MAX, max_bs=80, max_num_tokens=80, options=options)


def info_for(slots: list[int]) -> LoraBatchInfo:
    return LoraBatchInfo.from_segments([1] * len(slots), slots, RANKS, SCALINGS, "cpu")


def stacked_a(num_slices: int, gen) -> torch.Tensor:
    a = torch.randn(NUM_SLOTS, num_slices * R_MAX, K, generator=gen) / K**0.5
    rows = torch.arange(num_slices * R_MAX) % R_MAX
    return a * (rows[None, :] < torch.tensor(RANKS)[:, None]).float()[:, :, None]  # zero past each rank


class FoldingNative(TorchNativeLoraBackend):
    """torch_native with the contract's reference expand_folded: the core's folded layer on plain torch."""

    folds_shrink = True


@pytest.mark.parametrize("offsets", [[0, 48, 64, 80], [0, 56, 112], [0, 72]])
@pytest.mark.parametrize("slots", [[2], [0, 1, 2, 3, 1, 0, 3], [0, 0]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_n", [None, 32])  # None: one program per token on CPU; 32: spans cut the slices
def test_expand_kernel_and_reference_equal_the_unfolded_lora(offsets, slots, dtype, block_n):
    from backplane.plugins.lora_triton import folded

    gen = torch.Generator().manual_seed(len(slots) + len(offsets))
    num_slices, n, t = len(offsets) - 1, offsets[-1], len(slots)
    w = torch.randn(n, K, generator=gen) / K**0.5
    a = stacked_a(num_slices, gen)
    b = torch.randn(NUM_SLOTS, n, R_MAX, generator=gen) / R_MAX**0.5
    x = torch.randn(t, K, generator=gen)
    info = info_for(slots)
    native = TorchNativeLoraBackend(make_ctx())
    native.prepare_batch(info)
    want = native.apply_lora(x, a, b, offsets, x @ w.T)
    w, a, b, x = (v.to(dtype) for v in (w, a, b, x))
    y = x @ torch.cat([w, a.reshape(-1, K)]).T  # the folded GEMM
    got = folded.folded_expand(y, n, b, offsets, torch.empty(t, n, dtype=dtype), info.token_slots, info.scalings,
                               block_n=block_n)
    reference = FoldingNative(make_ctx())
    reference.prepare_batch(info)
    ref = reference.expand_folded(y, n, b, offsets, torch.empty(t, n, dtype=dtype))
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), want, **tol)
    torch.testing.assert_close(ref.float(), want, **tol)
    if 0 in slots:  # base-only tokens get exactly the base output
        rows = torch.tensor([s == 0 for s in slots])
        torch.testing.assert_close(got[rows], y[rows, :n])


def test_expand_kernel_names_bad_shapes():
    from backplane.plugins.lora_triton import folded

    b = torch.zeros(NUM_SLOTS, 80, R_MAX)
    info = info_for([1])
    with pytest.raises(ValueError, match="expected y of 272 columns"):
        folded.folded_expand(torch.zeros(1, 100), 80, b, [0, 48, 64, 80], torch.empty(1, 80), info.token_slots,
                             info.scalings)
    with pytest.raises(ValueError, match="offsets from 0 to num_base=80"):
        folded.folded_expand(torch.zeros(1, 80 + NUM_SLOTS * R_MAX), 80, b, [0, 40], torch.empty(1, 80),
                             info.token_slots, info.scalings)


class Block(torch.nn.Module):
    """The projections of one decoder layer, named as the wrapper expects (model.layers.N.*)."""

    def __init__(self, bias: bool):
        super().__init__()
        attn, mlp = torch.nn.Module(), torch.nn.Module()
        attn.qkv_proj = QKVParallelLinear(K, 16, 3, 1, bias=bias, params_dtype=torch.float32)
        attn.o_proj = RowParallelLinear(48, K, bias=bias, params_dtype=torch.float32)
        mlp.gate_up_proj = MergedColumnParallelLinear(K, [56, 56], bias=bias, params_dtype=torch.float32)
        self.self_attn, self.mlp = attn, mlp


def make_model(backend, bias: bool, seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([Block(bias)])
    for p in model.parameters():
        p.data.normal_()
    runtime = LoraRuntime(backend, ForwardSlot())
    wrappers = wrap_model(model, runtime, NUM_SLOTS, R_MAX)
    gen = torch.Generator().manual_seed(seed + 1)
    for layer in wrappers:  # the same random adapters in every slot but 0, each zero past its rank
        for slot in range(1, NUM_SLOTS):
            pairs = [(torch.randn(RANKS[slot], layer.lora_a.shape[2], generator=gen),
                      torch.randn(layer.offsets[j + 1] - layer.offsets[j], RANKS[slot], generator=gen))
                     for j in range(layer.num_slices)]
            layer.load_slot(slot, pairs)
    return model, runtime, {layer.projections[0]: layer for layer in wrappers}


@pytest.mark.parametrize("bias", [False, True])
def test_folded_layers_equal_unfolded_ones(bias, monkeypatch):
    from backplane.lora import layers as lora_layers

    plain_model, plain_rt, plain = make_model(TorchNativeLoraBackend(make_ctx()), bias)
    folded_model, folded_rt, folded = make_model(FoldingNative(make_ctx()), bias)
    for name, layer in folded.items():
        base = layer.base_layer
        assert layer.w_ext is not None and base.weight.data_ptr() == layer.w_ext.data_ptr()
        assert layer.lora_a.data_ptr() == layer.w_ext[base.weight.shape[0]:].data_ptr()
        torch.testing.assert_close(base.weight, plain[name].base_layer.weight)  # same weights, now a view
        torch.testing.assert_close(layer.lora_a, plain[name].lora_a)
    calls = []
    real_linear = torch.nn.functional.linear
    monkeypatch.setattr(lora_layers.torch.nn.functional, "linear",
                        lambda x, w, b=None: calls.append(w.shape[0]) or real_linear(x, w, b))
    gen = torch.Generator().manual_seed(5)
    for slots in ([1, 0, 2, 3, 3], [0, 0], [2]):
        x = torch.randn(len(slots), K, generator=gen)
        with contextlib.ExitStack() as bound:
            for rt in (plain_rt, folded_rt):  # each model's forward binds its LoRA info
                info = info_for(slots)
                rt.backend.prepare_batch(info)
                bound.enter_context(rt.forward_slot.enter(ForwardContext(None, None, None, {"lora": info})))
            for name, layer in folded.items():
                inputs = x if layer.lora_a.shape[2] == K else torch.randn(len(slots), 48, generator=gen)
                calls.clear()
                got = layer(inputs)
                assert calls == [layer.w_ext.shape[0]], "a folded pass is one GEMM over [W; A]"
                torch.testing.assert_close(got, plain[name](inputs), atol=1e-4, rtol=1e-4)
    assert folded_rt.batch_info is None  # LoRA off (nothing bound): the base layer alone, over the view of W
    x = torch.randn(3, K, generator=gen)
    torch.testing.assert_close(folded["q_proj"](x), plain["q_proj"].base_layer(x))


def test_triton_option_selects_the_folded_decode_path():
    from backplane.plugins.lora_triton.backend import TritonLoraBackend
    from backplane.plugins.lora_triton.options import TritonLoraOptions

    assert not TritonLoraBackend(make_ctx(TritonLoraOptions(decode_path="fused"))).folds_shrink
    backend = TritonLoraBackend(make_ctx(TritonLoraOptions()))  # folded is the default
    assert backend.folds(64) and not backend.folds(65)  # decode-sized batches only; prefill keeps the segments
    with pytest.raises(ValueError, match="decode_path"):
        TritonLoraOptions(decode_path="bgmv")
