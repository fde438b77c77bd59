"""Options of the "fp8" quantization method: `--fp8.<option>` on the command line."""

from __future__ import annotations

import re
from dataclasses import dataclass

from pydantic import BaseModel, Field, field_validator

_BLOCK = re.compile(r"^\s*(\d+)\s*[xX,]\s*(\d+)\s*$")


def parse_block(text: str) -> tuple[int, int]:
    """"128x128" (or "128,128") -> (128, 128); ValueError naming the option otherwise."""
    match = _BLOCK.match(text)
    if match is None or not all(int(v) > 0 for v in match.groups()):
        raise ValueError(f"--fp8.online-block {text!r}: expected ROWSxCOLUMNS of a weight block, two integers > 0 "
                         "(e.g. 128x128)")
    return int(match[1]), int(match[2])


class Fp8Options(BaseModel):
    """How `--quantization fp8` quantizes a bf16 checkpoint online, and where the CUDA kernels' launch
    table comes from (cuda.py)."""

    online_block: str | None = Field(
        None,
        description="quantize a bf16 checkpoint online to block-wise FP8 (one scale per ROWSxCOLUMNS weight block, "
        "activations per 1 x COLUMNS group: the layout of DeepSeek and Qwen3 FP8 checkpoints), e.g. 128x128; "
        "default: per-channel weight scales, per-token activations",
    )
    configs: str | None = Field(
        None,
        description="a JSON launch table written by python -m backplane.plugins.quant_fp8.tune; "
        "default: configs/<GPU name>.json bundled with the plugin, if there is one for this GPU",
    )
    tuned: bool = Field(True, description="use the table; false: the rule of thumb (default_launch) chooses every launch")
    pdl: bool = Field(True, description="launch the Triton FP8 GEMMs with programmatic dependent launch on Hopper and "
                      "newer: each starts reading its weight while the previous kernel finishes; false: plain launches")

    @field_validator("online_block")
    @classmethod
    def _valid_block(cls, value: str | None) -> str | None:
        if value is not None:
            parse_block(value)
        return value

    @property
    def block(self) -> tuple[int, int] | None:
        return parse_block(self.online_block) if self.online_block else None


@dataclass(frozen=True)
class TableSource:
    """Where a layer's launches come from: `configs`, the path of a table tune.py wrote (`--fp8.configs`),
    or None for the GPU's bundled one; `tuned` False (`--no-fp8.tuned`): no table, default_launch
    chooses every launch; `pdl` False (`--no-fp8.pdl`): the GEMMs launch without programmatic
    dependent launch (kernels.pdl_device). `stamp`: the file's modification time when the engine was built, so a
    table rewritten in place is read again by the next engine instead of served from the cache."""

    configs: str | None = None
    tuned: bool = True
    stamp: int | None = None
    pdl: bool = True


BUNDLED = TableSource()  # no options: the GPU's bundled table
