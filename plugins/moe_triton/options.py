"""Options of the "triton" MoE backend: `--triton-moe.<option>` on the command line."""

from __future__ import annotations

from pydantic import BaseModel, Field


class TritonMoeOptions(BaseModel):
    """Where the kernels' launch configurations come from (configs.py), and the one-token layout."""

    configs: str | None = Field(
        None,
        description="a JSON table of launch configurations written by python -m backplane.plugins.moe_triton.tune; "
        "default: configs/<GPU name>.json bundled with the plugin, if there is one for this GPU",
    )
    tuned: bool = Field(True, description="use the table; false: the rule of thumb chooses every launch")
    one_token_layout: bool = Field(
        True, description="one token's k experts in a fixed layout, without align's launch (backend.py); false: "
        "every token count is sorted by align, as before 6cf05a4 (for A/B runs)")
