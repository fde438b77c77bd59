"""SpecRequest, what an algorithm sees of a request: its values against the engine's request, the
algorithm-owned state (dropped when the request finishes, is preempted or is collected), the
per-request acceptance counts, and the 0.1 attribute names kept with a DeprecationWarning."""

from __future__ import annotations

import gc

import pytest
import torch

from backplane import Engine, SamplingParams
from backplane.scheduler.request import Req, FinishReason
from backplane.speculative import RequestAcceptance, SpecRequest
from backplane.speculative.request import RequestStore, engine_requests

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _req(prompt=(5, 6, 7, 8), output=(9, 10), row=3, num_cached=5) -> Req:
    req = Req(rid=7, prompt_ids=list(prompt), params=SamplingParams(), output_ids=list(output))
    req.row, req.num_cached = row, num_cached
    req.slots = [torch.tensor([11, 12, 13]), torch.tensor([20, 21, 22, 23])]  # 3 cached, then verify slots
    return req


def test_the_view_reads_the_request():
    req = _req()
    view = SpecRequest(req, RequestStore())
    assert (view.rid, view.num_tokens, view.last_token, view.num_cached, view.row) == (7, 6, 10, 5, 3)
    assert view.token_ids == [5, 6, 7, 8, 9, 10]
    assert view.tokens(3) == [8, 9, 10] and view.tokens(1, 5) == [6, 7, 8, 9] and view.tokens(6) == []
    assert view.cached_slots().tolist() == [11, 12, 13, 20, 21]
    view.token_ids.append(99)  # a copy: the request is unchanged
    assert req.output_ids == [9, 10]
    req.output_ids.append(11)  # a view, not a snapshot
    assert view.last_token == 11 and view.num_tokens == 7


def test_the_view_is_read_only_but_for_state():
    view = SpecRequest(_req(), RequestStore())
    for name, value in (("num_cached", 0), ("row", 1), ("token_ids", []), ("slots", [])):
        with pytest.raises(AttributeError):
            setattr(view, name, value)
    with pytest.raises(AttributeError):
        view.output_ids  # noqa: B018 - the engine's request fields are not on the view
    with pytest.raises(ValueError, match=r"SpecRequest.tokens: expected 0 <= start <= stop <= 6, got start 4, stop 2"):
        view.tokens(4, 2)


def test_state_is_kept_per_request_and_dropped_when_it_finishes_or_is_preempted():
    store = RequestStore()
    a, b, c = _req(), _req(), _req()
    for req, value in ((a, "A"), (b, "B"), (c, "C")):
        SpecRequest(req, store).state = value
    assert [SpecRequest(r, store).state for r in (a, b, c)] == ["A", "B", "C"]  # a fresh view sees it
    a.finish_reason = FinishReason.LENGTH
    b.row = None  # released (preempted): its KV is gone
    store.prune()
    assert [SpecRequest(r, store).state for r in (a, b, c)] == [None, None, "C"]
    assert store.num_states() == 1


def test_entries_go_with_the_request_object():
    store = RequestStore()
    req = _req()
    SpecRequest(req, store).state = torch.zeros(4)
    store.entry(req).acceptance.steps = 2
    assert len(store) == 1
    del req
    gc.collect()
    assert len(store) == 0


def test_engine_requests_unwraps_views():
    req, other = _req(), object()
    assert engine_requests([SpecRequest(req, RequestStore()), other]) == [req, other]


def test_the_old_names_warn_and_still_work():
    view = SpecRequest(_req(), RequestStore())
    with pytest.warns(DeprecationWarning, match=r"request.all_ids is deprecated.*SpecRequest.token_ids"):
        assert view.all_ids == [5, 6, 7, 8, 9, 10]
    with pytest.warns(DeprecationWarning, match=r"request.spec_state is deprecated.*SpecRequest.state"):
        view.spec_state = "S"
    assert view.state == "S"


def test_one_state_for_old_and_new_code():
    """A 0.1 algorithm wrote `req.spec_state` on the engine's request in its own forward_prefill;
    the view reads and writes that same value, and pruning drops it too."""
    req, store = _req(), RequestStore()
    req.spec_state = "old"
    view = SpecRequest(req, store)
    assert view.state == "old"
    view.state = "new"
    assert req.spec_state == "new" and store.num_states() == 1
    req.row = None
    store.prune()
    assert req.spec_state is None and view.state is None


def test_acceptance_counts_per_request_add_up_to_the_run(monkeypatch):
    """Each request's counts (SpecWorker.acceptance) sum to the worker's SpecStats; states are
    dropped once their requests finish (seen at the next step, and when the request is collected)."""
    engine = Engine("tiny-llama", device="cpu", attention_backend="torch_native", max_total_tokens=2048,
                    speculative_algorithm="ngram", speculative_num_draft_tokens=4)
    worker, seen, states = engine.spec_worker, {}, []
    decode = worker.decode

    def spy(reqs):
        out = decode(reqs)
        seen.update({id(r): r for r in reqs})
        for r in reqs:
            SpecRequest(r, worker.request_store).state = r.rid  # a state for each request
        states.append((worker.request_store.num_states(), len(engine.scheduler.running)))
        return out

    monkeypatch.setattr(worker, "decode", spy)
    prompts = [[11, 12, 13] * 4, [5, 6, 7, 8] * 3, [40, 41]]
    params = [SamplingParams(max_new_tokens=n, **GREEDY) for n in (20, 9, 14)]
    engine.generate(input_ids=prompts, sampling_params=params)
    counts = [worker.acceptance(r) for r in seen.values()]
    assert all(isinstance(c, RequestAcceptance) and c.steps > 0 for c in counts)
    assert sum(c.tokens for c in counts) == worker.stats.tokens
    assert sum(c.steps for c in counts) == worker.stats.request_steps
    assert sum(c.accepted_drafts for c in counts) == worker.stats.tokens - worker.stats.request_steps
    assert max(c.mean_acceptance_length for c in counts) > 1  # the repeated motifs were accepted
    assert all(num <= running for num, running in states), states  # no state outlives its request's step
    seen.clear()
    engine.generate(input_ids=[[3, 4]], sampling_params=SamplingParams(max_new_tokens=6, **GREEDY))
    assert states[-1][0] == 1  # the first call's states are gone


def test_acceptance_as_json():
    counts = RequestAcceptance(steps=4, accepted_drafts=6, tokens=10)
    assert counts.to_dict() == {"steps": 4, "accepted_drafts": 6, "tokens": 10, "mean_acceptance_length": 2.5}
    assert RequestAcceptance().mean_acceptance_length == 0.0
