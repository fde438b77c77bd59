"""docs/plugins.md, "Speculative algorithms": its example plugin runs as written (greedy output equal
to plain output, each request's state counted), and the tables name the real members."""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest

from backplane import Engine, SamplingParams
from backplane.speculative import SpecRequest, TargetView

DOC = (Path(__file__).resolve().parents[2] / "docs" / "plugins.md").read_text()
SECTION = DOC[DOC.index("## Speculative algorithms"):]
SECTION = SECTION[: SECTION.index("\n## ", 3)]
GREEDY = dict(temperature=0.0, ignore_eos=True)


def _example_plugin() -> types.ModuleType:
    code = re.search(r"```python\n(.*?)```", SECTION, re.S).group(1)
    module = types.ModuleType("repeat_plugin")
    exec(compile(code, "docs/plugins.md", "exec"), module.__dict__)  # noqa: S102 - the documented example
    return module


def test_the_example_plugin_runs_and_keeps_greedy_output():
    kw = dict(device="cpu", attention_backend="torch_native", max_total_tokens=1024)
    prompts = [[7, 7, 7, 7], [5, 6, 7, 8, 9]]
    params = SamplingParams(max_new_tokens=10, **GREEDY)
    want = Engine("tiny-llama", **kw).generate(input_ids=prompts, sampling_params=params)
    engine = Engine("tiny-llama", speculative_algorithm="repeat", speculative_num_draft_tokens=4,
                    plugins=[_example_plugin()], **kw)
    worker, states = engine.spec_worker, []
    draft = worker.draft

    def spy(reqs):
        tree = draft(reqs)
        states.extend(r.state for r in reqs)
        return tree

    worker.draft = spy
    got = engine.generate(input_ids=prompts, sampling_params=params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert states and max(states) > 1 and worker.stats.steps > 0


def _table(heading: str) -> list[str]:
    part = SECTION[SECTION.index(heading):]
    part = part[: part.index("\n### ", 1)] if "\n### " in part[1:] else part
    return [m for row in re.findall(r"^\| (.+?) \|", part, re.M) for m in re.findall(r"`(\w+)", row)]


@pytest.mark.parametrize("heading, cls", [("### The request view", SpecRequest), ("### The target", TargetView)])
def test_the_tables_name_real_members(heading, cls):
    names = [n for n in _table(heading) if n not in ("field", "member")]
    assert len(names) >= 9
    missing = [n for n in names if not hasattr(cls, n)]
    assert missing == [], f"docs/plugins.md {heading!r} names members {cls.__name__} lacks"
