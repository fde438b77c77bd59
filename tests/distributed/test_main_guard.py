"""`Engine(tp_size=2)` at the top level of a script without a main guard: each worker re-imports the
script; instead of starting workers of its own it exits at once, and rank 0's error says why."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time


def test_a_script_without_a_main_guard_is_told_why(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent("""
        from backplane import Engine

        engine = Engine("tiny-llama", device="cpu", tp_size=2, max_total_tokens=256)
        print("served")
        engine.shutdown()
    """))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0 and "served" not in proc.stdout
    guard = 'put the Engine under `if __name__ == "__main__":`'
    assert "tensor-parallel worker rank 1 failed: it re-ran the script that creates the Engine" in proc.stderr
    assert guard in proc.stderr and elapsed < 200
