"""`Fp8Scheme`: which scales an FP8 checkpoint holds and how activations are quantized."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fp8Scheme:
    """weights: "tensor" | "channel" | "block". activations: "tensor" | "token" | "group" | "none"
    (weight-only). static_input: activations use the checkpoint's `input_scale` (per tensor).
    block: (rows, columns) of a weight block. scale_name: the checkpoint's name of the weight scale.
    online: the checkpoint is bf16 and the weights are quantized after loading.
    activation_scale_ub (per-token activations only; fbgemm_fp8): each row's max |x| is clamped to
    this before its scale is taken, scale = min(amax, ub) / 448, and larger values saturate at +-448."""

    weights: str
    activations: str
    static_input: bool = False
    block: tuple[int, int] | None = None
    scale_name: str = "weight_scale"
    online: bool = False
    activation_scale_ub: float | None = None

    def __post_init__(self):
        ub = self.activation_scale_ub
        if ub is not None and (self.activations != "token" or not ub > 0):
            raise ValueError(f"Fp8Scheme: activation_scale_ub {ub} with activations {self.activations!r}: expected "
                             "a bound > 0 on per-token activations")
