"""bench/steps.py's engine lifetimes and bench/serving.py's command line: engines built side by side are
shut down and unreferenced when the measurement returns or raises; a bad --request-rates is one line."""

from __future__ import annotations

import gc
import weakref

import pytest

import helpers_bench  # noqa: F401 - the repository root on sys.path
from bench import serving, steps


class FakeEngine:
    """Stands in for backplane.Engine: records its settings and whether it was shut down."""

    built: list[weakref.ref] = []
    shut: list[str] = []

    def __init__(self, model=None, **settings):
        self.model, self.settings = model, settings
        self.cycle = self  # NOTE: a reference cycle, as real engines have: only the collector frees it
        FakeEngine.built.append(weakref.ref(self))

    def shutdown(self) -> None:
        FakeEngine.shut.append(self.model)


@pytest.fixture
def fake_engine(monkeypatch):
    monkeypatch.setattr(steps, "Engine", FakeEngine)
    FakeEngine.built, FakeEngine.shut = [], []
    gc.disable()  # the release must collect by itself
    yield
    gc.enable()


def test_engines_built_side_by_side_are_shut_down_and_freed(fake_engine):
    settings = {"a": {"model": "m1", "x": 1}, "b": {"model": "m2"}}
    got = steps.with_engines(settings, lambda engines: {name: (e.model, e.settings) for name, e in engines.items()})
    assert got == {"a": ("m1", {"x": 1}), "b": ("m2", {})}
    assert sorted(FakeEngine.shut) == ["m1", "m2"]
    assert [ref() for ref in FakeEngine.built] == [None, None]


def test_an_error_still_shuts_every_engine_down(fake_engine):
    def fail(engine):
        raise RuntimeError("measurement failed")

    with pytest.raises(RuntimeError, match="measurement failed"):
        steps.with_engine({"model": "m"}, fail)
    assert FakeEngine.shut == ["m"]


@pytest.mark.parametrize("rates", ["1,fast", "0,inf", "-2", ""])
def test_bad_request_rates_are_one_line_naming_the_flag(rates, capsys):
    with pytest.raises(SystemExit) as stop:
        serving.parse_args(["--request-rates", rates])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == 2 and "--request-rates" in err and "expected positive numbers or inf" in err and repr(rates) in err
