"""The public API against its checked-in snapshot (tests/public_api.txt), and every deprecated
name still working with a DeprecationWarning that names its new import.

After a deliberate change of the public API, regenerate the snapshot with
`python tests/test_public_api.py --update` and commit it with the change.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from pathlib import Path

import pytest

from backplane.deprecation import DEPRECATED_MODULES, all_moved
from backplane.testing.boundary import api_changes, public_api

SNAPSHOT = Path(__file__).with_name("public_api.txt")
HINT = "if the change is meant, regenerate the snapshot: python tests/test_public_api.py --update"


def read_snapshot(path: Path = SNAPSHOT) -> dict[str, str]:
    lines = [line.split() for line in path.read_text().splitlines() if line and not line.startswith("#")]
    return {name: kind for name, kind in lines}


def write_snapshot(path: Path = SNAPSHOT) -> None:
    header = "# every public name and its kind; regenerate: python tests/test_public_api.py --update\n"
    path.write_text(header + "".join(f"{name} {kind}\n" for name, kind in public_api().items()))


def test_public_api_matches_the_snapshot():
    problems = api_changes(read_snapshot(), public_api(), set(all_moved()))
    assert not problems, "; ".join(problems) + f" ({HINT})"


def test_a_planted_disappearance_fails_and_a_deprecated_one_passes():
    current = public_api()
    planted = {**current, "backplane.FrobnicatorSpec": "class"}  # in the snapshot, gone from the code
    assert api_changes(planted, current, set()) == [
        "backplane.FrobnicatorSpec (class) disappeared without a deprecation entry; keep it, or alias it with "
        "backplane.deprecation.moved_names"]
    assert api_changes(planted, current, {"backplane.FrobnicatorSpec"}) == []


def test_a_planted_new_name_or_kind_change_fails():
    snapshot = public_api()
    current = {**snapshot, "backplane.Unlisted": "function", "backplane.hookimpl": "class"}
    assert api_changes(snapshot, current, set()) == ["backplane.hookimpl changed kind: function -> class",
                                                     "backplane.Unlisted (function) is new and not in the snapshot"]


# The first release's documented API (docs/plugins.md at 8fa8f0f) and the names moved since.
FIRST_RELEASE = {
    "backplane.batch.ForwardMode": "backplane.ForwardMode",
    "backplane.batch.ForwardBatch": "backplane.ForwardBatch",
    "backplane.memory.ReqToTokenPool": "backplane.ReqToTokenPool",
    "backplane.memory.TokenToKVPool": "backplane.TokenToKVPool",
    "backplane.ServerArgs": "backplane.EngineArgs",
    "backplane.attention.base.AttentionBackend": "backplane.contracts.attention.AttentionBackend",
    "backplane.lora.base.LoraBackend": "backplane.contracts.lora.LoraBackend",
}


def _resolve(dotted: str):
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("old", sorted(FIRST_RELEASE))
def test_first_release_names_are_registered_deprecations(old):
    assert all_moved()[old].new == FIRST_RELEASE[old]


@pytest.mark.parametrize("old", sorted(all_moved()))
def test_every_deprecated_name_warns_with_its_new_import(old):
    moved = all_moved()[old]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = _resolve(old)
    new_module, _, new_name = moved.new.rpartition(".")
    assert [str(w.message) for w in caught if w.category is DeprecationWarning] == [moved.message()]
    assert f"from {new_module} import {new_name}" in moved.message()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert value is _resolve(moved.new)


def test_deprecated_modules_are_aliases_only():
    for module in DEPRECATED_MODULES:
        assert any(name.startswith(module + ".") for name in all_moved()), f"{module} registers no moved name"


if __name__ == "__main__":  # pragma: no cover - the regeneration command named in HINT
    if sys.argv[1:] != ["--update"]:
        sys.exit(f"usage: python {sys.argv[0]} --update")
    write_snapshot()
    print(f"wrote {SNAPSHOT}")
