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


# NOTE: CPython 3.11+ keeps frames on a per-thread stack of chunks (16 KiB, mmap'd, freed when the
# last frame in them returns). A hot loop whose calls cross a chunk boundary maps and unmaps a chunk
# (page faults, TLB shootdowns) at every call: where the boundary falls depends on the depth at which
# the tests run (`python -m pytest` adds runpy's frames), and measured on 2 cores it made the Triton
# interpreter's tests 2-3x slower (an ngram verify run: 2.1 s standalone, 5.7 s under `python -m
# pytest`). Running the test loop under one frame that reserves 2 MiB puts every test's frames in one
# 4 MiB chunk, far from any boundary.
def _call_in_big_frame(fn, *args):
    return fn(*args)


_call_in_big_frame.__code__ = _call_in_big_frame.__code__.replace(co_stacksize=1 << 18)


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    from _pytest import main

    others = [impl.plugin for impl in session.config.hook.pytest_runtestloop.get_hookimpls()
              if not impl.hookwrapper and not impl.wrapper and impl.function is not pytest_runtestloop]
    if others != [main]:  # another runner (xdist, ...) owns the loop: leave it be
        return None
    return _call_in_big_frame(main.pytest_runtestloop, session)


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
