"""Every bundled attention backend passes the conformance suite on the GPU (bf16), graph replay included."""

import pytest

from backplane.testing import attention_conformance

pytestmark = pytest.mark.gpu

test_triton = attention_conformance.make_suite("triton", device="cuda")
test_flashinfer = attention_conformance.make_suite("flashinfer", device="cuda")
test_triton_graphs = attention_conformance.make_graph_suite("triton")
test_flashinfer_graphs = attention_conformance.make_graph_suite("flashinfer")


def _extend_verify_options():
    from backplane.plugins.attention_triton.options import TritonAttentionOptions

    return TritonAttentionOptions(verify_kernel="extend")


# The default TARGET_VERIFY kernel is the split-KV one; this covers the extend kernel's verify path.
test_triton_extend_verify = attention_conformance.make_suite("triton", device="cuda", options=_extend_verify_options())
