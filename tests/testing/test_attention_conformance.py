"""torch_native passes the attention conformance suite, and the suite catches wrong backends."""

from __future__ import annotations

import pytest
import torch

from backplane import AttentionBackendSpec
from backplane.attention.torch_native import TorchNativeAttnBackend
from backplane.testing import attention_conformance
from backplane.testing.attention_conformance import base_cases, check_case

test_torch_native = attention_conformance.make_suite("torch_native", device="cpu")


class IgnoresPrefix(TorchNativeAttnBackend):
    """Wrong on purpose: attends only to the new tokens."""

    def forward_extend(self, q, k, v, layer, batch):
        saved = batch.req_to_token_pool.req_to_token.clone()
        prefix = batch.extend_prefix_lens_cpu.tolist()
        for i, p in enumerate(prefix):
            row = int(batch.req_pool_indices[i])
            batch.req_to_token_pool.req_to_token[row, :p] = batch.req_to_token_pool.req_to_token[row, p]
        try:
            return super().forward_extend(q, k, v, layer, batch)
        finally:
            batch.req_to_token_pool.req_to_token.copy_(saved)


class IgnoresMask(TorchNativeAttnBackend):
    """Wrong on purpose: every draft token sees every other one (the tree mask is ignored)."""

    def init_forward_metadata(self, batch):
        batch.custom_mask = torch.ones_like(batch.custom_mask)
        super().init_forward_metadata(batch)


class IgnoresSoftcap(TorchNativeAttnBackend):
    def forward(self, q, k, v, layer, batch):
        from dataclasses import replace

        return super().forward(q, k, v, replace(layer, logit_softcap=0.0), batch)


def _spec(cls):
    return AttentionBackendSpec(name=cls.__name__, factory=cls, description="wrong on purpose")


CASES = {c.name: c for c in base_cases(small=True)}


@pytest.mark.parametrize("cls, case", [
    (IgnoresPrefix, "extend-with-prefix"),
    (IgnoresMask, "verify-tree-mask"),
    (IgnoresSoftcap, "softcap-decode"),
])
def test_the_suite_catches_a_wrong_backend(cls, case):
    with pytest.raises(AssertionError, match=case):
        check_case(_spec(cls), CASES[case], "cpu", torch.float32)
    check_case(_spec(TorchNativeAttnBackend), CASES[case], "cpu", torch.float32)


class DoubleScaleDecode(TorchNativeAttnBackend):
    """Wrong on purpose: decode with twice the softmax scaling."""

    def forward_decode(self, q, k, v, layer, batch):
        from dataclasses import replace

        return super().forward_decode(q, k, v, replace(layer, scaling=2 * layer.scaling), batch)


def test_compile_case_torch_native_and_a_wrong_backend():
    """The graph suite's compile case, on CPU: torch_native through the opaque op in a compiled
    region equals eager torch_native; a wrong decode is caught."""
    from backplane.testing.graph_conformance import check_compiled_decode

    assert check_compiled_decode(_spec(TorchNativeAttnBackend), torch.float32, "cpu", steps=4) < 1e-4
    with pytest.raises(AssertionError, match="compiled decode through torch.ops.backplane.attention"):
        check_compiled_decode(_spec(DoubleScaleDecode), torch.float32, "cpu", steps=4)
