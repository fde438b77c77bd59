"""docs/plugins.md documents the quant hook and every QuantMethodSpec default as the code has it."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

from backplane.plugin import hookspecs
from backplane.plugin.registry import QuantMethodSpec

DOC = (Path(__file__).resolve().parents[3] / "docs" / "plugins.md").read_text()


def _render(value) -> str:
    if callable(value):
        return "always available"
    if isinstance(value, tuple):
        return ", ".join(value) or "()"
    return f'"{value}"' if isinstance(value, str) else str(value)


def test_the_spec_defaults_table_matches_the_dataclass():
    rest = DOC[DOC.index("`QuantMethodSpec`:"):]
    rows = {}
    for line in rest[rest.index("| ---"):].splitlines()[1:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[re.findall(r"`([a-z_]+)`", cells[0])[0]] = cells[1]
    defaults = {f.name: f.default for f in dataclasses.fields(QuantMethodSpec) if f.default is not dataclasses.MISSING}
    assert rows == {name: f"`{_render(value)}`" for name, value in defaults.items()}


def test_the_hook_is_documented_with_its_signature():
    assert "def backplane_register_quant_methods(register: Callable[[QuantMethodSpec], None]) -> None" in DOC
    assert list(inspect.signature(hookspecs.backplane_register_quant_methods).parameters) == ["register"]
