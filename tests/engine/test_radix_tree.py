"""The radix tree alone: matching splits edges, insert keeps cached slots and frees duplicates,
references protect a path, eviction frees unreferenced leaves least recently used first."""

from __future__ import annotations

import torch

from backplane.scheduler.radix import RadixTree, common_length


def slots(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


class FreedLog:
    def __init__(self):
        self.freed: list[int] = []

    def __call__(self, s: torch.Tensor) -> None:
        self.freed += s.tolist()


def test_common_length_over_odd_sizes():
    for n in (0, 1, 7, 33):
        for cut in range(n + 1):
            a = list(range(n))
            b = a[:cut] + [-1] * (n - cut)
            assert common_length(a, b) == cut
    assert common_length([1, 2, 3], [1, 2]) == 2


def test_match_ends_inside_an_edge_by_splitting_it():
    tree = RadixTree()
    tree.insert([1, 2, 3, 4], slots(11, 12, 13, 14))
    m = tree.match([1, 2, 9])
    assert m.slots.tolist() == [11, 12] and m.node.key == [1, 2]
    assert tree.match([1, 2, 3, 4, 5]).slots.tolist() == [11, 12, 13, 14]
    assert tree.match([7]).length == 0
    assert tree.total_size == 4 and tree.evictable_size == 4


def test_insert_keeps_cached_slots_and_frees_duplicates():
    log = FreedLog()
    tree = RadixTree(log)
    assert tree.insert([1, 2, 3], slots(11, 12, 13)) == 0
    # The same first two tokens computed again (slots 21, 22) and one shared slot (13): 21, 22 are freed.
    assert tree.insert([1, 2, 3, 4], slots(21, 22, 13, 24)) == 3
    assert sorted(log.freed) == [21, 22]
    assert tree.match([1, 2, 3, 4]).slots.tolist() == [11, 12, 13, 24]
    assert sorted(tree.all_slots().tolist()) == [11, 12, 13, 24]


def test_namespaces_never_share():
    tree = RadixTree()
    tree.insert([1, 2, 3], slots(11, 12, 13), "adapter_a")
    assert tree.match([1, 2, 3], "adapter_b").length == 0
    assert tree.match([1, 2, 3]).length == 0
    assert tree.match([1, 2, 3], "adapter_a").length == 3


def test_locked_paths_survive_eviction_and_lru_order():
    log = FreedLog()
    tree = RadixTree(log)
    tree.insert([1, 2, 3], slots(11, 12, 13))
    tree.insert([1, 2, 5], slots(11, 12, 15))  # splits: [1, 2] -> {[3], [5]}
    tree.insert([8, 9], slots(18, 19))
    tree.match([8, 9])  # [8, 9] used most recently; [1, 2, 3] least
    held = tree.match([1, 2, 5]).node
    tree.lock(held)
    assert tree.protected_size == 3 and tree.evictable_size == 3
    assert tree.evict(1) == 1 and log.freed == [13]  # the LRU unreferenced leaf
    assert tree.evict(10) == 2 and sorted(log.freed) == [13, 18, 19]  # [1, 2] and [5] are referenced
    assert tree.match([1, 2, 5]).length == 3
    tree.unlock(held)
    assert tree.evictable_size == 3 and tree.evict(10) == 3
    assert tree.total_size == 0 and sorted(log.freed) == [11, 12, 13, 15, 18, 19]


def test_split_keeps_references_of_the_lower_part():
    tree = RadixTree()
    tree.insert([1, 2, 3, 4], slots(11, 12, 13, 14))
    node = tree.match([1, 2, 3, 4]).node
    tree.lock(node)
    tree.match([1, 2])  # splits the locked edge
    assert tree.protected_size == 4 and tree.evict(10) == 0
    tree.unlock(node)
    assert tree.protected_size == 0 and tree.evictable_size == 4


def test_match_stop_and_match_length_agree_with_slicing_the_key():
    tree = RadixTree()
    tree.insert([1, 2, 3, 4, 5, 6], slots(11, 12, 13, 14, 15, 16))
    tree.insert([1, 2, 3, 9, 9], slots(11, 12, 13, 19, 19))
    for key in ([1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 9, 8], [1, 2], [2, 1], []):
        for stop in (None, 0, 1, 3, 4, 5, 10):
            want = tree.match_length(key[:stop])
            nodes = sum(1 for _ in tree.nodes())
            assert tree.match_length(key, stop=stop) == want
            assert sum(1 for _ in tree.nodes()) == nodes  # match_length splits nothing
            assert tree.match(key, stop=stop).length == want == tree.match(key[:stop]).length
    assert tree.match_length([1, 2, 3], "adapter") == 0 and "adapter" not in tree.roots
