"""The benchmarks are the package `bench` at the repository root: importable as such under
`python -m pytest` from the root; this puts the root on sys.path for other ways of running pytest.
Also the smallest CPU settings every smoke run of a benchmark shares."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CPU = ["--device", "cpu"]  # with tiny-llama and torch_native: every benchmark's CPU smoke run
