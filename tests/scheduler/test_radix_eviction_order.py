"""The radix tree's eviction heap: the same leaves freed in the same order as the walk of the whole
tree it replaced (a copy of that evict is the reference here), over random sequences of insert, match,
lock, unlock, evict and flush; evicting k leaves touches O(k log n) entries, not the tree (plus one
for each use of a leaf since its entry was pushed); the heap never holds more entries than nodes."""

from __future__ import annotations

import heapq

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import backplane.scheduler.radix as radix
from backplane.scheduler.radix import RadixNode, RadixTree


class WalkingTree(RadixTree):
    """The reference: evict as it was before the heap, a walk of the whole tree and a heapify of every
    unreferenced leaf at each call (RadixNode.__lt__ orders them by last access)."""

    def evict(self, num_slots: int) -> int:
        heap = [n for n in self.nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_slots and heap:
            leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            self.evictable_size -= len(leaf.key)
            freed += len(leaf.key)
            if self.free_slots is not None:
                self.free_slots(leaf.slots)
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed


class FreedLog:
    """free_slots: every call's slots, in order."""

    def __init__(self):
        self.calls: list[list[int]] = []

    def __call__(self, s: torch.Tensor) -> None:
        self.calls.append(s.tolist())


def snapshot(tree: RadixTree) -> list:
    """The tree as plain values: per namespace, every node's key, slots, references and last access,
    children in first-token order."""
    def node(n: RadixNode) -> tuple:
        kids = [node(n.children[t]) for t in sorted(n.children)]
        return tuple(n.key), tuple(n.slots.tolist()), n.lock_ref, n.last_access, kids
    return [(repr(ns), node(tree.roots[ns])) for ns in sorted(tree.roots, key=repr)]


def check_accounting(tree: RadixTree) -> None:
    nodes = list(tree.nodes())
    assert tree.protected_size == sum(len(n.key) for n in nodes if n.lock_ref > 0)
    assert tree.evictable_size == sum(len(n.key) for n in nodes if n.lock_ref == 0)
    assert tree.evictable_size + tree.protected_size == tree.total_size == sum(len(n.key) for n in nodes)


def check_heap(tree: RadixTree) -> None:
    """One entry per node marked in_heap and none for any other node (an evicted one included); every
    unreferenced leaf has one; an entry's access is at most its node's."""
    nodes = list(tree.nodes())
    entries = [id(n) for _, _, n in tree._heap]
    assert len(entries) == len(set(entries)), "a node with two heap entries"
    assert set(entries) == {id(n) for n in nodes if n.in_heap}, "an entry for a node not in the tree or not marked"
    assert all(n.in_heap for n in nodes if not n.children and n.lock_ref == 0), "an unreferenced leaf without an entry"
    assert all(access <= n.last_access for access, _, n in tree._heap)
    assert len(entries) <= len(nodes)


# -- random operations ------------------------------------------------------------------------------

NAMESPACES = st.sampled_from([None, "adapter"])
KEYS = st.lists(st.integers(0, 3), min_size=1, max_size=8)  # a small alphabet: shared prefixes, splits
OPS = st.one_of(
    st.tuples(st.just("insert"), NAMESPACES, KEYS, st.booleans()),  # bool: lock the node where the key ends
    st.tuples(st.just("match"), NAMESPACES, KEYS, st.one_of(st.none(), st.integers(0, 8)), st.booleans()),
    st.tuples(st.just("match_length"), NAMESPACES, KEYS),
    st.tuples(st.just("unlock"), st.integers(0, 31)),
    st.tuples(st.just("evict"), st.integers(0, 12)),
    st.tuples(st.just("flush")),
)


class Pair:
    """The reference tree and the heap tree driven alike, with the nodes locked in each."""

    def __init__(self):
        self.logs = FreedLog(), FreedLog()
        self.trees = WalkingTree(self.logs[0]), RadixTree(self.logs[1])
        self.held: list[tuple[RadixNode, RadixNode]] = []
        self.next_slot = 100

    def apply(self, op: tuple) -> None:
        getattr(self, op[0])(*op[1:])
        a, b = self.trees
        assert self.logs[0].calls == self.logs[1].calls, op
        assert snapshot(a) == snapshot(b), op
        assert (a.evictable_size, a.protected_size) == (b.evictable_size, b.protected_size), op
        check_accounting(b)
        check_heap(b)

    def insert(self, ns, key: list[int], lock: bool) -> None:
        slots = torch.arange(self.next_slot, self.next_slot + len(key))  # fresh: cached positions are duplicates
        self.next_slot += len(key)
        nodes = tuple(t.insert_node(key, slots, ns) for t in self.trees)
        assert nodes[0].key == nodes[1].key
        if lock:
            self.lock(nodes)

    def match(self, ns, key: list[int], stop: int | None, lock: bool) -> None:
        a, b = (t.match(key, ns, stop) for t in self.trees)
        assert a.slots.tolist() == b.slots.tolist()
        if lock:
            self.lock((a.node, b.node))

    def match_length(self, ns, key: list[int]) -> None:
        a, b = (t.match_length(key, ns) for t in self.trees)
        assert a == b

    def lock(self, nodes: tuple[RadixNode, RadixNode]) -> None:
        for tree, node in zip(self.trees, nodes):
            tree.lock(node)
        self.held.append(nodes)

    def unlock(self, i: int) -> None:
        if self.held:
            for tree, node in zip(self.trees, self.held.pop(i % len(self.held))):
                tree.unlock(node)

    def evict(self, n: int) -> None:
        a, b = (t.evict(n) for t in self.trees)
        assert a == b

    def flush(self) -> None:
        a, b = (t.evict(t.evictable_size) for t in self.trees)
        assert a == b and self.trees[1].evictable_size == 0


@settings(max_examples=400, deadline=None)
@given(ops=st.lists(OPS, min_size=1, max_size=60))
def test_heap_evicts_what_the_tree_walk_evicted(ops):
    pair = Pair()
    for op in ops:
        pair.apply(op)
    while pair.held:  # every request finishes: then everything goes, in the same order
        pair.apply(("unlock", 0))
    pair.apply(("flush",))
    assert all(t.total_size == 0 for t in pair.trees)


def test_a_long_sequence_with_both_namespaces_matches_the_walk():
    """One long deterministic run (thousands of operations on a tree of a few hundred nodes), beside
    hypothesis's short ones."""
    import random

    rng, pair = random.Random(5), Pair()
    for _ in range(3000):
        ns, key = rng.choice([None, "adapter"]), [rng.randrange(4) for _ in range(rng.randint(1, 12))]
        kind = rng.choices(["insert", "match", "unlock", "evict"], weights=[4, 4, 3, 2])[0]
        op = {"insert": ("insert", ns, key, rng.random() < 0.3),
              "match": ("match", ns, key, rng.choice([None, rng.randrange(12)]), rng.random() < 0.3),
              "unlock": ("unlock", rng.randrange(32)), "evict": ("evict", rng.randrange(20))}[kind]
        pair.apply(op)
    assert pair.trees[1].total_size > 0 and pair.logs[1].calls  # the run did evict and kept a tree


# -- cost -------------------------------------------------------------------------------------------

class Touches:
    """Counts what an eviction reads: nodes the tree walk yields, node comparisons, heap pops and pushes."""

    def __init__(self, monkeypatch, tree: RadixTree):
        self.count = 0
        walk, less = tree.nodes, RadixNode.__lt__

        def nodes():
            for n in walk():
                self.count += 1
                yield n

        def lt(a, b):
            self.count += 1
            return less(a, b)

        class CountingHeapq:
            @staticmethod
            def heappop(heap):
                self.count += 1
                return heapq.heappop(heap)

            @staticmethod
            def heappush(heap, item):
                self.count += 1
                heapq.heappush(heap, item)

            heapify = staticmethod(heapq.heapify)

        monkeypatch.setattr(tree, "nodes", nodes)
        monkeypatch.setattr(RadixNode, "__lt__", lt)
        monkeypatch.setattr(radix, "heapq", CountingHeapq)


def ten_thousand_leaves(tree_type: type[RadixTree], log: FreedLog) -> RadixTree:
    """10,000 leaves under 10 + 1,000 inner nodes (keys of 4 tokens, 2 on each leaf), inserted in a shuffled order."""
    import random

    tree = tree_type(log)
    keys = [[i // 1000, 100 + (i // 10) % 100, 200 + i % 10, 300 + i] for i in range(10_000)]
    random.Random(0).shuffle(keys)
    for key in keys:
        tree.insert(key, torch.tensor(key) + 1000)
    return tree


def least_recent_leaves(tree: RadixTree, k: int) -> list[RadixNode]:
    return [n for n in sorted(tree.nodes(), key=lambda n: n.last_access) if not n.children][:k]


@pytest.mark.parametrize("tree_type", [RadixTree, WalkingTree])
def test_evicting_k_leaves_touches_order_k_entries_not_the_tree(monkeypatch, tree_type):
    log = FreedLog()
    tree = ten_thousand_leaves(tree_type, log)
    want = [n.slots.tolist() for n in least_recent_leaves(tree, 101)]
    touches = Touches(monkeypatch, tree)
    assert tree.evict(1) == 2
    one = touches.count
    assert tree.evict(200) == 200
    hundred = touches.count - one
    assert log.calls == want  # least recently used first
    if tree_type is WalkingTree:  # the measure sees the walk: each call reads every leaf
        assert one >= 10_000 and hundred >= 10_000
        return
    assert one <= 2, f"evict of 1 leaf of 10,000 touched {one} entries"
    assert hundred <= 2 * 100, f"evict of 100 leaves of 10,000 touched {hundred} entries"


def test_a_use_since_the_push_costs_one_more_pop_once(monkeypatch):
    """m leaves used again after their push: evicting k leaves pops at most k + m entries (each used
    leaf's entry goes back once, at its new access), the rest of the tree untouched."""
    log = FreedLog()
    tree = ten_thousand_leaves(RadixTree, log)
    used = least_recent_leaves(tree, 50)
    for n in used:  # the 50 next in line become the most recently used; their entries still say otherwise
        tree.match([*n.parent.parent.key, *n.parent.key, *n.key])
    want = [n.slots.tolist() for n in least_recent_leaves(tree, 100)]
    touches = Touches(monkeypatch, tree)
    assert tree.evict(200) == 200
    assert log.calls == want
    assert all(n.parent.children.get(n.key[0]) is n for n in used)  # the used ones are still in the tree
    assert 100 + 50 <= touches.count <= 100 + 2 * 50 + 10  # a pop per evicted leaf, a pop and a push per used one
    check_heap(tree)


def test_the_heap_holds_at_most_one_entry_per_node_when_leaves_are_used_over_and_over():
    tree = RadixTree()
    for i in range(10):
        tree.insert([i, 1, 2], torch.arange(3 * i, 3 * i + 3))
    for step in range(3000):  # matches, references and their release: no entry is added
        node = tree.match([step % 10, 1, 2][:1 + step % 3]).node
        tree.lock(node)
        tree.unlock(node)
        if step % 100 == 99:
            tree.evict(1)
            tree.insert([step % 10, 1, 2], torch.arange(3))
        check_heap(tree)
    assert len(tree._heap) <= sum(1 for _ in tree.nodes())
    size = tree.total_size
    assert size > 0 and tree.evict(size) == size and tree.total_size == 0 and not tree._heap
