"""Options of the "triton" LoRA backend: `--triton-lora.<option>` on the command line."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class TritonLoraOptions(BaseModel):
    """Where the fused decode kernel's measured launch settings come from (tuned.py), and which decode
    path LoRA takes."""

    configs: str | None = Field(
        None,
        description="a JSON table of fused-kernel launch settings written by python -m bench.lora_kernels --tune; "
        "default: configs/<GPU name>.json bundled with the plugin, if there is one for this GPU",
    )
    tuned: bool = Field(True, description="use the measured table; false: the read model chooses every launch")
    decode_path: Literal["fused", "folded"] = Field(
        "folded",
        description="decode-sized batches: 'fused', one shrink-and-expand kernel per projection group after the "
        "base GEMM; 'folded', every adapter slot's A stacked under the base weight so the base GEMM also "
        "shrinks, then one expand kernel (folded.py)",
    )
