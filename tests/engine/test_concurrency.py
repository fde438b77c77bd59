"""Engine.generate from several threads at once, and interrupted calls (docs/reliability.md R45, R46).

R45: 8 threads x 50 requests on one Engine come back equal to solo runs; the pool is whole after.
R46: a KeyboardInterrupt (or any exception) out of the progress callback aborts that call's
requests and frees their slots before it propagates; the next call starts with the pool whole.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from backplane import Engine, SamplingParams
from helpers_models import unused_slots

PARAMS = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
ROWS = ["R45", "R46"]


@pytest.fixture(scope="module")
def engine():
    return Engine("tiny-llama", device="cpu", attention_backend="torch_native",
                  max_total_tokens=2048, max_running_requests=16)


def _free(engine) -> tuple[int, int]:
    """KV slots no request holds (the prefix cache's count as unused) and free request rows."""
    return unused_slots(engine), engine.runner.req_to_token_pool.num_free


def _prompt(thread: int, i: int) -> list[int]:
    return [(thread * 53 + i * 7 + k) % 500 + 1 for k in range(3 + (i % 4))]


def test_concurrent_generate_matches_solo_runs(engine):  # R45
    start = _free(engine)
    threads, per_thread = 8, 50
    solo = {}
    for t in range(threads):  # one batched call per thread, serially: the reference
        outs = engine.generate(input_ids=[_prompt(t, i) for i in range(per_thread)], sampling_params=PARAMS)
        solo[t] = [o.token_ids for o in outs]
    results: dict[int, list[list[int]]] = {}
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            outs = []
            for i in range(0, per_thread, 10):  # several calls per thread interleave with the others
                outs += engine.generate(input_ids=[_prompt(t, j) for j in range(i, i + 10)], sampling_params=PARAMS)
            results[t] = [o.token_ids for o in outs]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors, errors
    assert results == solo
    assert _free(engine) == start
    assert not engine.scheduler.running and not engine.scheduler.waiting


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_interrupt_from_progress_frees_the_call(engine, exc):  # R46
    start = _free(engine)
    prompts = [_prompt(1, i) for i in range(6)]
    expected = [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=PARAMS)]
    long = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)

    def progress(finished):
        assert engine.runner.req_to_token_pool.num_free < start[1]  # rows (and their slots) are held mid-call
        raise exc("stop")

    with pytest.raises(exc):
        engine.generate(input_ids=prompts, sampling_params=long, progress=progress)
    assert _free(engine) == start
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=PARAMS)] == expected
    assert _free(engine) == start


def test_table_lists_rows():
    table = (Path(__file__).resolve().parents[2] / "docs" / "reliability.md").read_text()
    for row in ROWS:
        assert f"| {row} |" in table
