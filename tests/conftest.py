"""Shared test setup: fixture plugin packages install for real. (The `gpu` marker and its skip
without CUDA come from backplane's pytest plugin, `backplane.testing.pytest_plugin`.)"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"

import torch  # noqa: E402 - decides the Triton mode before anything imports triton

if not torch.cuda.is_available():
    # Without a GPU the Triton kernels run in Triton's interpreter; it must be chosen before the
    # first `import triton`, which any test module may trigger.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    import torch

    if not config.pluginmanager.has_plugin("backplane"):  # a checkout installed before the pytest11 entry point
        from backplane.testing import pytest_plugin

        config.pluginmanager.register(pytest_plugin, "backplane")

    # The CPU tests run tiny models, for which one thread is far faster than several contending.
    if not torch.cuda.is_available():
        torch.set_num_threads(1)


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "-q", *args], check=True)


class InstalledPackages:
    """pip-installs fixture distributions into the test environment and removes them afterwards."""

    def __init__(self):
        self.installed: list[str] = []

    def install(self, folder: str, dist: str) -> None:
        _pip("install", "--no-deps", "--no-build-isolation", "--no-index", str(FIXTURES / folder))
        self.installed.append(dist)
        importlib.invalidate_caches()

    def uninstall(self, dist: str) -> None:
        _pip("uninstall", "-y", dist)
        self.installed.remove(dist)
        for name in [m for m in sys.modules if m.startswith(dist.replace("-", "_"))]:
            del sys.modules[name]
        importlib.invalidate_caches()

    def cleanup(self) -> None:
        for dist in list(self.installed):
            self.uninstall(dist)


@pytest.fixture(scope="session")
def fixture_packages():
    packages = InstalledPackages()
    yield packages
    packages.cleanup()


@pytest.fixture(scope="session")
def example_plugin(fixture_packages):
    """The third-party plugin package `backplane-example-plugin`, installed with pip."""
    fixture_packages.install("example_plugin", "backplane-example-plugin")
    return "example"


@pytest.fixture(scope="module")
def bad_plugins(fixture_packages):
    """`backplane-bad-plugins`: broken plugins, one per way to fail; tests pick one with BACKPLANE_PLUGINS.

    Uninstalled again after the module, so no other test sees them."""
    fixture_packages.install("bad_plugins", "backplane-bad-plugins")
    yield ("bad_import", "bad_register", "duplicate", "misspelt", "bad_syntax", "bad_args", "bad_spec")
    fixture_packages.uninstall("backplane-bad-plugins")


@pytest.fixture
def no_bad_plugins(monkeypatch):
    """Load only the bundled plugins (and the example plugin) regardless of what is installed."""
    monkeypatch.setenv(
        "BACKPLANE_PLUGINS",
        "attention_triton,attention_flashinfer,lora_triton,spec_eagle,spec_ngram,example",
    )
