"""Every bundled attention backend passes the conformance suite on the GPU (bf16), graph replay included."""

import pytest

from backplane.testing import attention_conformance

pytestmark = pytest.mark.gpu

test_triton = attention_conformance.make_suite("triton", device="cuda")
test_flashinfer = attention_conformance.make_suite("flashinfer", device="cuda")
test_triton_graphs = attention_conformance.make_graph_suite("triton")
test_flashinfer_graphs = attention_conformance.make_graph_suite("flashinfer")


def _split_verify_options():
    from backplane.plugins.attention_triton.options import TritonAttentionOptions

    return TritonAttentionOptions(verify_kernel="split")


test_triton_split_verify = attention_conformance.make_suite("triton", device="cuda", options=_split_verify_options())
