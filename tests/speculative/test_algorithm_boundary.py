"""The bundled speculative plugins stay on the public face: public imports only, no attribute of the
engine's request or of the model runner that the views do not offer, and at run time nothing but
the SpecRequest view (slotted: no other attribute exists) and the TargetView facade."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest

from backplane import Engine, SamplingParams
from backplane.scheduler.request import Req
from backplane.speculative import SpecRequest
from backplane.speculative.request import RequestStore
from backplane.testing.boundary import check_plugin_imports

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = {"spec_eagle": ROOT / "plugins" / "spec_eagle", "spec_ngram": ROOT / "plugins" / "spec_ngram"}
# The engine request's and model runner's own names, which an algorithm must not reach for.
PRIVATE = {"spec_state", "all_ids", "prompt_ids", "output_ids", "ids_between", "token_at", "slots", "params",
           "finish_reason", "lora", "graph_runner", "attn_choices", "registry", "_req", "_runner", "_store",
           "scheduler", "layer_infos"}
STRICT = r"(request|TargetRunner)\.\w+ is deprecated"


def private_attributes(folder: Path) -> list[str]:
    """`file:line .name` for every attribute access in `folder`'s modules whose name is private."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in PRIVATE:
                found.append((path.name, node.lineno, node.attr))
    return [f"{file}:{line} .{attr}" for file, line, attr in sorted(found)]


@pytest.mark.parametrize("name", sorted(PLUGINS))
def test_public_imports_only(name):
    assert check_plugin_imports(PLUGINS[name], f"backplane.plugins.{name}") == []


@pytest.mark.parametrize("name", sorted(PLUGINS))
def test_no_private_request_or_runner_attribute(name):
    assert private_attributes(PLUGINS[name]) == []


def test_the_attribute_check_sees_a_planted_access(tmp_path):
    (tmp_path / "worker.py").write_text("def draft(self, reqs):\n    return [r.all_ids[-1] for r in reqs]\n"
                                        "x = self.runner.graph_runner.sizes\n")
    assert private_attributes(tmp_path) == ["worker.py:2 .all_ids", "worker.py:3 .graph_runner"]


def test_the_strict_filter_turns_an_old_name_into_an_error():
    view = SpecRequest(Req(rid=0, prompt_ids=[1, 2], params=SamplingParams()), RequestStore())
    with warnings.catch_warnings():
        warnings.filterwarnings("error", STRICT, DeprecationWarning)
        with pytest.raises(DeprecationWarning):
            view.all_ids  # noqa: B018
        with pytest.raises(AttributeError):
            view.prompt_ids  # noqa: B018 - slotted: the request's fields are not there at all


def test_ngram_runs_on_views_only():
    engine = Engine("tiny-llama", device="cpu", attention_backend="torch_native", max_total_tokens=1024,
                    speculative_algorithm="ngram", speculative_num_draft_tokens=4)
    worker, kinds = engine.spec_worker, set()
    draft = worker.draft

    def spy(reqs):
        kinds.update(type(r) for r in reqs)
        return draft(reqs)

    worker.draft = spy
    with warnings.catch_warnings():
        warnings.filterwarnings("error", STRICT, DeprecationWarning)
        outs = engine.generate(input_ids=[[4, 5, 6] * 3], sampling_params=SamplingParams(max_new_tokens=9,
                                                                                         temperature=0.0))
    assert outs[0].error is None and len(outs[0].token_ids) == 9
    assert kinds == {SpecRequest}
