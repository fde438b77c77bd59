"""Options of the "triton" LoRA backend: `--triton-lora.<option>` on the command line."""

from __future__ import annotations

from pydantic import BaseModel, Field


class TritonLoraOptions(BaseModel):
    """Where the fused decode kernel's measured launch settings come from (tuned.py)."""

    configs: str | None = Field(
        None,
        description="a JSON table of fused-kernel launch settings written by bench/lora_decode.py --tune; "
        "default: configs/<GPU name>.json bundled with the plugin, if there is one for this GPU",
    )
    tuned: bool = Field(True, description="use the measured table; false: the read model chooses every launch")
