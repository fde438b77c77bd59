"""The bundled LoRA backends pass backplane.testing's LoRA conformance suite (CPU: fp32 and fp16;
Triton under the interpreter; graph cases exercise the capture/replay metadata path eagerly)."""

from backplane.testing import lora_conformance

test_torch_native = lora_conformance.make_suite("torch_native")
test_triton = lora_conformance.make_suite("triton")
