"""The Triton attention backend passes the conformance suite under the Triton interpreter (fp32, fp16)."""

import pytest
import torch

from backplane.plugins.attention_triton.options import TritonAttentionOptions
from backplane.testing import attention_conformance

if torch.cuda.is_available():
    pytest.skip("the interpreter run is for CPU machines; tests/gpu covers the GPU", allow_module_level=True)

test_triton_fp32 = attention_conformance.make_suite("triton", device="cpu", dtype=torch.float32)
test_triton_fp16 = attention_conformance.make_suite("triton", device="cpu", dtype=torch.float16)

# TARGET_VERIFY through the extend kernel (--triton-attention.verify-kernel extend; the default is split).
test_triton_extend_verify_fp32 = attention_conformance.make_suite(
    "triton", device="cpu", dtype=torch.float32, options=TritonAttentionOptions(verify_kernel="extend"))
