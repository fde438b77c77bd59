"""The plugin's option group "flashinfer": `--flashinfer.workspace-size-mb`, `--flashinfer.decode-use-tensor-cores`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class FlashInferOptions(BaseModel):
    """Options of the flashinfer attention backend (env: BACKPLANE_FLASHINFER__<OPTION>)."""

    workspace_size_mb: int = Field(
        default=256,
        ge=16,
        description="size of the float workspace that every FlashInfer wrapper of the backend shares (MiB)",
    )
    decode_use_tensor_cores: Literal["auto", "true", "false"] = Field(
        default="auto",
        description="decode through the tensor-core (prefill) kernel; auto: over an FP8 KV cache, or when "
        "num_heads / num_kv_heads > 4",
    )

    def use_tensor_cores(self, num_heads: int, num_kv_heads: int, kv_fp8: bool = False) -> bool:
        """Whether decode uses tensor cores for this head layout and KV element type."""
        if self.decode_use_tensor_cores == "auto":
            # Over an FP8 cache the CUDA-core kernel converts every K/V element on the CUDA cores and
            # is the slow one: 1.3-1.9x the tensor-core kernel's time at GQA 32/8 (H200, bs 8 x 16k:
            # 245 against 131 us; bs 1 x 16k: 44 against 34; docs/performance.md, "Attention kernels", FP8 KV
            # decode), as SGLang also picks. Over bf16 at a group of 4 (Llama 3.2 1B and 3.1 8B) the
            # CUDA-core kernel is the faster one at the decode bench's short contexts on an H100, and
            # its planner is cheaper (docs/performance.md, "CUDA-core decode").
            return kv_fp8 or num_heads // num_kv_heads > 4
        return self.decode_use_tensor_cores == "true"
