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
    assert frozen >= len(alive) and gc.get_freeze_count() == frozen
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
