"""The name under which tests/plugins/lora_triton/test_lora_tuned.py imports the LoRA kernel benchmark
(with bench/ on sys.path); its code is bench/lora_kernels.py, which this module is. Remove it once
that test imports bench.lora_kernels."""

import sys

from bench import lora_kernels

sys.modules[__name__] = lora_kernels  # one module object: the test's monkeypatch of time_us reaches tune_fused
