"""Options of the "fp8" quantization method: `--fp8.<option>` on the command line."""

from __future__ import annotations

import re

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
    """How `--quantization fp8` quantizes a bf16 checkpoint online."""

    online_block: str | None = Field(
        None,
        description="quantize a bf16 checkpoint online to block-wise FP8 (one scale per ROWSxCOLUMNS weight block, "
        "activations per 1 x COLUMNS group: the layout of DeepSeek and Qwen3 FP8 checkpoints), e.g. 128x128; "
        "default: per-channel weight scales, per-token activations",
    )

    @field_validator("online_block")
    @classmethod
    def _valid_block(cls, value: str | None) -> str | None:
        if value is not None:
            parse_block(value)
        return value

    @property
    def block(self) -> tuple[int, int] | None:
        return parse_block(self.online_block) if self.online_block else None
