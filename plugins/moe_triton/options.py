"""Options of the "triton" MoE backend: `--triton-moe.<option>` on the command line."""

from __future__ import annotations

from pydantic import BaseModel, Field


class TritonMoeOptions(BaseModel):
    """Where the kernels' launch configurations come from (configs.py)."""

    configs: str | None = Field(
        None,
        description="a JSON table of launch configurations written by python -m backplane.plugins.moe_triton.tune; "
        "default: configs/<GPU name>.json bundled with the plugin, if there is one for this GPU",
    )
    tuned: bool = Field(True, description="use the table; false: the rule of thumb chooses every launch")
