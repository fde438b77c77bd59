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
        description="decode through the tensor-core (prefill) kernel; auto: when num_heads / num_kv_heads > 4",
    )

    def use_tensor_cores(self, num_heads: int, num_kv_heads: int) -> bool:
        """Whether decode uses tensor cores for this head layout."""
        if self.decode_use_tensor_cores == "auto":
            # At a group of 4 (Llama 3.2 1B and 3.1 8B) the CUDA-core decode kernel is the faster one
            # on an H100, and its planner is cheaper (docs/performance.md, "CUDA-core decode").
            return num_heads // num_kv_heads > 4
        return self.decode_use_tensor_cores == "true"
