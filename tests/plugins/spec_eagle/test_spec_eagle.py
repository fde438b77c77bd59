"""EAGLE on CPU: greedy output equals plain greedy; an exact head reaches full acceptance, a random
head almost none; the KV pools return to their start; checkpoint layouts and bad input."""

from __future__ import annotations

import random
import warnings
from contextlib import contextmanager

import pytest
import torch

from backplane import Engine, SamplingParams
from backplane.plugin.runtime import PluginRuntimeError
from helpers_models import unused_slots

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 290) for _ in range(rng.randint(1, 30))] for _ in range(count)]


# The 0.1 flags these tests were written with, and the "eagle" group's options that replace them.
NEW_NAMES = {"speculative_num_steps": "num_steps", "speculative_eagle_topk": "topk",
             "speculative_token_map": "token_map", "speculative_draft_model": "draft_model"}


def _engines(path, head, **spec):
    """A plain engine and an EAGLE one; EAGLE's options go through the "eagle" settings group."""
    kw = dict(device="cpu", dtype="float32", attention_backend="torch_native", max_total_tokens=2048,
              max_running_requests=12)
    plain = Engine(str(path), **kw)
    options = {NEW_NAMES[k]: spec.pop(k) for k in list(spec) if k in NEW_NAMES}
    with strict_contract():
        eagle = Engine(str(path), speculative_algorithm="eagle",
                       plugin_options={"eagle": {"draft_model": head, **options}}, **kw, **spec)
    return plain, eagle


@contextmanager
def strict_contract():
    """EAGLE touches no deprecated name of the request view or the target facade: each raises."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", r"(request|TargetRunner)\.\w+ is deprecated", DeprecationWarning)
        yield


def _check_equal(plain, eagle, prompts, max_new):
    params = [SamplingParams(max_new_tokens=m, **GREEDY) for m in max_new]
    want = plain.generate(input_ids=prompts, sampling_params=params)
    with strict_contract():
        got = eagle.generate(input_ids=prompts, sampling_params=params)
    for w, g in zip(want, got):
        assert g.error is None
        assert g.token_ids == w.token_ids
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)


@pytest.mark.parametrize("steps, topk, draft_tokens", [(3, 1, 4), (5, 1, 6), (3, 2, 6), (2, 3, 7)])
def test_exact_head_greedy_equal_and_full_acceptance(target, exact_head, steps, topk, draft_tokens):
    plain, eagle = _engines(target[0], exact_head, speculative_num_steps=steps, speculative_eagle_topk=topk,
                            speculative_num_draft_tokens=draft_tokens)
    prompts = _prompts(steps * 10 + topk, 9)
    _check_equal(plain, eagle, prompts, [random.Random(i).randint(1, 25) for i in range(9)])
    stats = eagle.spec_worker.stats
    if topk == 1:  # a chain: the exact head's drafts are all accepted
        assert stats.mean_acceptance_length == draft_tokens, stats.histogram
    else:  # the greedy path is in the tree whenever it scores high enough; most steps gain several
        assert stats.mean_acceptance_length > 2.0, stats.histogram
    assert unused_slots(eagle) == 2048


def test_random_head_greedy_equal_and_near_zero_acceptance(target, random_head):
    plain, eagle = _engines(target[0], random_head, speculative_num_steps=3, speculative_eagle_topk=2,
                            speculative_num_draft_tokens=5)
    for batch in (1, 5, 12):
        _check_equal(plain, eagle, _prompts(batch, batch), [17] * batch)
    assert eagle.spec_worker.stats.mean_acceptance_length < 1.3
    assert unused_slots(eagle) == 2048
    # Every draft pass bound its backend for that pass only; the target's stays its own.
    assert eagle.spec_worker.model_ctx.attn_backend is None
    assert eagle.runner.model_ctx.attn_backend is eagle.runner.attn_backend


@pytest.mark.parametrize("steps, topk", [(3, 2), (4, 1)])
def test_window_draft_equals_pending_draft(target, random_head, steps, topk):
    """The steady-state draft re-runs a fixed window of the last num_steps + 1 tokens (what the draft
    graph captures); it must propose what an extend over exactly the pending tokens proposes."""
    plain, eagle = _engines(target[0], random_head, speculative_num_steps=steps, speculative_eagle_topk=topk,
                            speculative_num_draft_tokens=5)
    worker, draft, compared = eagle.spec_worker, eagle.spec_worker.draft, []

    def both(reqs):
        if all(worker._fits_window(r) for r in reqs):
            pending, window = worker._draft_pending(reqs), worker._draft_window_eager(reqs)
            assert torch.equal(pending.tokens, window.tokens) and torch.equal(pending.parents, window.parents)
            torch.testing.assert_close(window.scores, pending.scores, atol=1e-5, rtol=1e-5)
            compared.append(len(reqs))
        return draft(reqs)

    worker.draft = both
    _check_equal(plain, eagle, _prompts(5, 6), [15] * 6)
    assert len(compared) >= 5 and max(compared) > 1, compared


def test_pool_returns_to_start_under_preemption(target, exact_head):
    kw = dict(device="cpu", dtype="float32", attention_backend="torch_native")
    plain = Engine(str(target[0]), max_total_tokens=2048, **kw)
    tight = Engine(str(target[0]), max_total_tokens=100, chunked_prefill_size=16, max_running_requests=4,
                   speculative_algorithm="eagle", speculative_draft_model=exact_head, speculative_num_steps=3,
                   speculative_num_draft_tokens=4, **kw)
    rows = tight.runner.req_to_token_pool.num_free
    prompts = [list(range(3 + i, 28 + i)) for i in range(6)]
    params = SamplingParams(max_new_tokens=20, **GREEDY)
    want = plain.generate(input_ids=prompts, sampling_params=params)
    got = tight.generate(input_ids=prompts, sampling_params=params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert unused_slots(tight) == 100
    assert tight.runner.req_to_token_pool.num_free == rows


def test_bad_draft_model_is_a_clear_error(target, tmp_path):
    with pytest.raises(ValueError, match="--speculative-algorithm eagle: needs a draft model; pass --eagle.draft-model"):
        Engine(str(target[0]), device="cpu", speculative_algorithm="eagle")
    with pytest.raises(PluginRuntimeError, match="--speculative-draft-model .*expected a directory with config.json"):
        Engine(str(target[0]), device="cpu", speculative_algorithm="eagle", speculative_draft_model=str(tmp_path))


def test_chain_on_device_keeps_what_select_tree_keeps():
    """Top-k 1: the draft hands verify the first num_draft_tokens - 1 candidates on the device;
    they must be the ones select_tree keeps (scores fall with depth; ties keep the shallower)."""
    from types import SimpleNamespace

    from backplane.plugins.spec_eagle.beams import Candidates
    from backplane.plugins.spec_eagle.worker import EagleWorker, select_tree

    gen = torch.Generator().manual_seed(4)
    bs, steps = 3, 7
    drops = -torch.rand(bs, steps, generator=gen)
    drops[:, 2] = 0.0  # a probability-1 step: equal scores at two depths
    candidates = Candidates(torch.randint(3, 500, (bs, steps), generator=gen), drops.cumsum(1),
                            torch.arange(steps).expand(bs, steps).clone())
    roots = [5, 6, 7]
    for n in (2, 4, 8):
        want = select_tree(roots, candidates, n)
        got = EagleWorker._chain(SimpleNamespace(num_draft_tokens=n), roots, candidates)
        assert got.tokens is None and torch.equal(got.device_tokens, want.tokens)
        assert torch.equal(got.parents, want.parents)


def test_token_map_restricts_the_draft_vocabulary(target, exact_head, tmp_path):
    """--speculative-token-map: a map of every token keeps the exact head's full acceptance; a map
    without the target's tokens drafts only mapped tokens (acceptance falls) and output stays greedy."""
    path, model = target
    vocab = model.config.vocab_size
    spec = dict(speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)
    plain, _ = _engines(path, exact_head)
    prompts = _prompts(21, 6)
    params = [SamplingParams(max_new_tokens=20, **GREEDY)] * len(prompts)
    want = plain.generate(input_ids=prompts, sampling_params=params)

    everything = tmp_path / "all.pt"
    torch.save(torch.randperm(vocab), everything)  # any order: the map is a set
    few = tmp_path / "few.pt"
    torch.save(list(range(3, 13)), few)  # a list of ids works too
    for token_map, full in ((everything, True), (few, False)):
        _, eagle = _engines(path, exact_head, speculative_token_map=str(token_map), **spec)
        got = eagle.generate(input_ids=prompts, sampling_params=params)
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        worker = eagle.spec_worker
        if full:
            assert worker.stats.mean_acceptance_length == 4, worker.stats.histogram
        else:
            assert worker.head.hot_ids.tolist() == list(range(3, 13))
            assert worker.stats.mean_acceptance_length < 4
            drafted = worker.head.top_tokens(torch.randn(5, model.config.hidden_size), 3)[1]
            assert set(drafted.view(-1).tolist()) <= set(range(3, 13))


def test_bad_token_map_is_a_clear_error(target, exact_head, tmp_path):
    bad = tmp_path / "bad.pt"
    torch.save(torch.tensor([1, 2, 10 ** 6]), bad)
    with pytest.raises(PluginRuntimeError, match=r"--eagle.token-map .*expected token ids in \[0, "):
        _engines(target[0], exact_head, speculative_token_map=str(bad))
    with pytest.raises(PluginRuntimeError, match="--eagle.token-map .*no such file"):
        _engines(target[0], exact_head, speculative_token_map=str(tmp_path / "missing.pt"))
    with pytest.raises(ValueError, match="--speculative-token-map: only algorithms with a draft model"):
        Engine(str(target[0]), device="cpu", speculative_algorithm="ngram", speculative_token_map=str(bad))


@pytest.mark.parametrize("steps, topk, draft_tokens", [(3, 1, 4), (2, 2, 4)])
def test_drafts_stop_at_the_context_end(target, exact_head, steps, topk, draft_tokens):  # docs/reliability.md R54
    """504 + 8 tokens on the 512-token context: near the end the request decodes plainly, and greedy
    output equals plain output up to the last position."""
    plain, eagle = _engines(target[0], exact_head, speculative_num_steps=steps, speculative_eagle_topk=topk,
                            speculative_num_draft_tokens=draft_tokens)
    assert eagle.runner.context_len == 512
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 290) for _ in range(n)] for n in (504, 509, 12)]
    params = [SamplingParams(max_new_tokens=m, **GREEDY) for m in (8, 3, 8)]
    want = plain.generate(input_ids=prompts, sampling_params=params)
    got = eagle.generate(input_ids=prompts, sampling_params=params)
    for w, g in zip(want, got):
        assert g.error is None and g.finish_reason == "length"
        assert g.token_ids == w.token_ids
    assert eagle.spec_worker.stats.mean_acceptance_length > 1  # the exact head's drafts were accepted
    assert unused_slots(eagle) == 2048
