"""Options of the "triton" attention backend: `--triton-attention.<option>` on the command line."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator


class TritonAttentionOptions(BaseModel):
    """Decode KV-split settings (extend needs none) and the kernel that serves TARGET_VERIFY."""

    num_kv_splits: int = Field(
        0, ge=0, description="KV splits per request in decode; 0 = chosen from batch size, heads and SMs"
    )
    max_kv_splits: int = Field(64, ge=1, le=1024, description="upper bound of the automatic choice")
    verify_kernel: Literal["extend", "split"] = Field(
        "split",
        description="TARGET_VERIFY attention: the split-KV kernel that reads a few draft tokens per request like "
        "decode (see docs/performance.md), or the extend kernel; sliding-window layers and groups too wide for "
        "one program always take the extend kernel",
    )

    @model_validator(mode="after")
    def _splits_within_bound(self) -> "TritonAttentionOptions":
        if self.num_kv_splits > self.max_kv_splits:
            raise ValueError(
                f"triton-attention.num_kv_splits: expected at most max_kv_splits={self.max_kv_splits}, "
                f"got {self.num_kv_splits}"
            )
        return self
