"""Fixture plugin packages of tests/plugin/ (the installer, `fixture_packages`, is tests/conftest.py's)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def legacy_plugin(fixture_packages):
    """`backplane-legacy-plugin`: an SDPA backend written against the first release (plugin API 1.0),
    pip-installed for the module and removed after it."""
    fixture_packages.install("legacy_plugin", "backplane-legacy-plugin")
    yield "legacy_sdpa"
    fixture_packages.uninstall("backplane-legacy-plugin")
