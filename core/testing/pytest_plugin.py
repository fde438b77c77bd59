"""The pytest plugin shipped with backplane (entry point `pytest11`: `backplane`).

Active in any pytest run where backplane is installed, so a plugin author's own test suite knows
the `gpu` marker that `backplane.testing`'s graph suites carry (no PytestUnknownMarkWarning), and
tests marked `gpu` are skipped with a reason on a machine without CUDA. Disable it with
`-p no:backplane`.
"""

from __future__ import annotations

import pytest

GPU_MARKER = "gpu: needs a CUDA GPU (skipped without one; run them with `pytest -m gpu` on a GPU machine)"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", GPU_MARKER)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any("gpu" in item.keywords for item in items):
        return
    import torch  # NOTE: only when a gpu test was collected; plain runs stay light

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run `pytest -m gpu` on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
