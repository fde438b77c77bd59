"""The serving processes freeze their startup heap (`freeze_startup_heap`): full garbage collections
then skip the objects that live as long as the process, and later garbage is still collected."""

import gc
import weakref

import pytest

from backplane.engine.engine_process import freeze_startup_heap


@pytest.fixture
def unfrozen():
    """The test process must not keep its objects frozen after the test (later garbage among them
    would never be collected)."""
    gc.unfreeze()
    yield
    gc.unfreeze()


class _Node:
    pass


def test_freezing_moves_the_live_heap_out_of_collections_and_later_cycles_still_go(unfrozen):
    alive = [_Node() for _ in range(1000)]  # long-lived startup objects
    frozen = freeze_startup_heap()
    # frozen objects that die leave the permanent generation: the count can only fall after the freeze
    # (it fell by 2 in a fresh-clone CI run, other tests' objects freed in between)
    assert frozen >= len(alive) and len(alive) <= gc.get_freeze_count() <= frozen
    assert not any(node is obj for obj in gc.get_objects() for node in alive[:3])  # not tracked for scanning
    a, b = _Node(), _Node()  # a cycle made after startup
    a.other, b.other = b, a
    ref = weakref.ref(a)
    del a, b
    gc.collect()
    assert ref() is None, "a garbage cycle allocated after the freeze was not collected"


def test_a_collection_before_the_freeze_frees_startup_garbage(unfrozen):
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    ref = weakref.ref(a)
    del a, b
    freeze_startup_heap()
    assert ref() is None, "garbage left before the freeze would be frozen forever"


def test_an_engine_with_gc_freeze_freezes_its_startup_and_shutdown_unfreezes(unfrozen):
    """--gc-freeze (off by default for a library caller): the engine and what startup left alive are
    frozen; generate still works and its later garbage cycles are collected; shutdown() unfreezes, so a
    dropped engine can be collected."""
    from backplane import Engine, SamplingParams

    plain = Engine("tiny-llama", device="cpu")
    assert plain.gc_frozen == 0 and gc.get_freeze_count() == 0
    plain.shutdown()
    engine = Engine("tiny-llama", device="cpu", gc_freeze=True)
    assert engine.gc_frozen > 10_000 and gc.get_freeze_count() > 10_000
    assert not any(obj is engine for obj in gc.get_objects(generation=2))  # frozen: not scanned
    out = engine.generate(input_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_new_tokens=3, temperature=0))
    assert len(out[0].token_ids) == 3
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    ref = weakref.ref(a)
    del a, b
    gc.collect()
    assert ref() is None, "a garbage cycle allocated after the freeze was not collected"
    ref = weakref.ref(engine.scheduler)
    engine.shutdown()
    assert engine.gc_frozen == 0 and gc.get_freeze_count() == 0
    del engine
    gc.collect()
    assert ref() is None, "a shut-down engine's scheduler was not collected"


def test_a_new_freeze_collects_an_engine_dropped_while_frozen(unfrozen):
    """An engine dropped without shutdown() while frozen is collected at the next engine's freeze."""
    from backplane import Engine

    first = Engine("tiny-llama", device="cpu", gc_freeze=True)
    ref = weakref.ref(first.scheduler)
    del first
    gc.collect()
    second = Engine("tiny-llama", device="cpu", gc_freeze=True)
    assert ref() is None, "the dropped frozen engine survived the next freeze"
    second.shutdown()
