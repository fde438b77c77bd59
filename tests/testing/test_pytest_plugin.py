"""backplane's pytest plugin (entry point pytest11 `backplane`) in a plugin author's own test run."""

from __future__ import annotations

import subprocess
import sys
import textwrap

AUTHOR_TEST = textwrap.dedent('''
    import pytest

    @pytest.mark.gpu
    def test_needs_a_gpu():
        import torch
        assert torch.cuda.is_available()

    def test_plain():
        pass
''')


def _run(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """pytest in a folder of its own (no backplane conftest or pyproject), unknown marks are errors."""
    (tmp_path / "test_author.py").write_text(AUTHOR_TEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "error::pytest.PytestUnknownMarkWarning",
         "-c", str(tmp_path / "pytest.ini"), *args, str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )


def test_gpu_marker_is_known_in_a_plugin_authors_run(tmp_path):
    import torch

    result = _run(tmp_path, "-rs")
    assert result.returncode == 0, result.stdout + result.stderr
    if not torch.cuda.is_available():
        assert "1 passed, 1 skipped" in result.stdout and "needs a CUDA GPU" in result.stdout
    markers = _run(tmp_path, "--markers")
    assert "@pytest.mark.gpu: needs a CUDA GPU" in markers.stdout


def test_without_the_plugin_the_marker_is_unknown(tmp_path):
    result = _run(tmp_path, "-p", "no:backplane")
    assert result.returncode != 0
    assert "Unknown pytest.mark.gpu" in result.stdout + result.stderr
