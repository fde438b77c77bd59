"""`Fp8Scheme`: which scales an FP8 checkpoint holds and how activations are quantized."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fp8Scheme:
    """weights: "tensor" | "channel" | "block". activations: "tensor" | "token" | "group" | "none"
    (weight-only). static_input: activations use the checkpoint's `input_scale` (per tensor).
    block: (rows, columns) of a weight block. scale_name: the checkpoint's name of the weight scale.
    online: the checkpoint is bf16 and the weights are quantized after loading."""

    weights: str
    activations: str
    static_input: bool = False
    block: tuple[int, int] | None = None
    scale_name: str = "weight_scale"
    online: bool = False
