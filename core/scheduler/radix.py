"""A radix tree over the KV pool: token-id prefixes -> the KV slots that hold them (page size 1).

Each edge of the tree holds a run of token ids and, slot for slot, the KV slots of those tokens.
A path from a root spells a token prefix; its slots are that prefix's KV. Requests on different
adapters never share KV, so each namespace (None for the base model, else the adapter name) has its
own root.

Ownership: every slot in the tree is owned by the tree. A running request that uses a cached
prefix holds a reference (`lock`) on the deepest node of its match; a referenced node and its
ancestors are never evicted. `evict(n)` frees unreferenced leaves, least recently used first,
until `n` slots are back in the pool (or nothing more is evictable).

Eviction pops a heap of (last access, push order, node) instead of walking the tree. Every
unreferenced leaf has exactly one entry, pushed when it became one, and no node has two; an entry's
access is at most its node's (a node's last access only grows: it is set to the clock's newest
value). An entry that comes up for a node used since is pushed back at the node's access, one for a
node referenced or given a child since is dropped (the node is pushed again when it is an
unreferenced leaf again). So the first entry that comes up unchanged is the least recently used
leaf, the heap never holds more entries than the tree has nodes, and evicting k leaves costs
O(k log n) plus one pop for each use, reference or child that came since its entry's push.
Two unreferenced leaves never share a last access (a match or insert stamps the nodes of one path,
and a path holds at most one leaf), so the order is total.

Accounting, at every moment: `evictable_size + protected_size == total_size` (tokens in the tree),
and free + total_size + slots private to requests == the pool's size.

The tree lives in the scheduler's process (rank 0 under tensor parallelism); it is host-only
bookkeeping and never touches the device.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Hashable

import torch


@dataclass(eq=False)
class RadixNode:
    """key: the token ids of the edge from the parent; slots: [len(key)] int64 (host)."""

    key: list[int]
    slots: torch.Tensor
    parent: RadixNode | None = None
    children: dict[int, RadixNode] = field(default_factory=dict)  # first token of the child's key -> child
    lock_ref: int = 0
    last_access: int = 0
    in_heap: bool = False  # the tree's eviction heap holds an entry for this node (see the module doc)

    def __lt__(self, other: RadixNode) -> bool:  # least recently used first (the eviction heap orders so too)
        return self.last_access < other.last_access


@dataclass
class PrefixMatch:
    """The longest cached prefix of a key: its slots [length] int64 (host) and the node where it ends
    (a root when nothing matched). Lock `node` to keep the prefix while it is used."""

    slots: torch.Tensor
    node: RadixNode

    @property
    def length(self) -> int:
        return int(self.slots.numel())


def common_length(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists (slice comparisons run in C)."""
    n = min(len(a), len(b))
    a, b = a if len(a) == n else a[:n], b if len(b) == n else b[:n]
    if a == b:
        return n
    lo, hi = 0, n - 1  # the answer is in [lo, hi]: a[:lo] == b[:lo], a[:hi + 1] != b[:hi + 1]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


_EMPTY = torch.empty(0, dtype=torch.int64)
_FEW_SLOTS = 32  # at most this many slots are compared as lists (a recomputed last token: one)


def join_slots(pieces: list[torch.Tensor]) -> torch.Tensor:
    """Slot tensors (host int64) one after the other; a single piece is returned as it is, not
    copied: nothing writes into a slot tensor, the tree's or a request's."""
    if len(pieces) == 1:
        return pieces[0]
    return torch.cat(pieces) if pieces else _EMPTY


class RadixTree:
    """The tree and its reference counts. `free_slots(slots)` is called with evicted and duplicate
    slots (the KV pool's `free`); None keeps the tree pure bookkeeping (the scheduler's in-batch
    check uses it that way)."""

    def __init__(self, free_slots=None):
        self.free_slots = free_slots
        self.roots: dict[Hashable, RadixNode] = {}
        self.evictable_size = 0
        self.protected_size = 0
        self._clock = itertools.count(1)
        self._heap: list[tuple[int, int, RadixNode]] = []  # (access, push order, node), see the module doc
        self._pushes = itertools.count()

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    def root(self, namespace: Hashable = None) -> RadixNode:
        if namespace not in self.roots:
            self.roots[namespace] = RadixNode([], _EMPTY, lock_ref=1)  # a root is never evicted
        return self.roots[namespace]

    # -- match and insert -----------------------------------------------------------------------

    def match(self, key: list[int], namespace: Hashable = None, stop: int | None = None) -> PrefixMatch:
        """The longest cached prefix of `key[:stop]` (all of `key` when stop is None). A node the
        match ends inside is split there, so the match always ends at a node boundary; every node on
        the path counts as used now."""
        node, pieces, i = self.root(namespace), [], 0
        end = len(key) if stop is None else min(stop, len(key))
        now = next(self._clock)
        node.last_access = now
        while i < end and key[i] in node.children:
            child = node.children[key[i]]
            n = common_length(child.key, key[i:min(i + len(child.key), end)])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            pieces.append(child.slots)
            node, i = child, i + n
        return PrefixMatch(join_slots(pieces), node)

    def match_length(self, key: list[int], namespace: Hashable = None, stop: int | None = None) -> int:
        """How many leading tokens of `key[:stop]` are cached; read only (no split, no use counted)."""
        node, i = self.roots.get(namespace), 0
        end = len(key) if stop is None else min(stop, len(key))
        while node is not None and i < end and key[i] in node.children:
            child = node.children[key[i]]
            n = common_length(child.key, key[i:min(i + len(child.key), end)])
            i += n
            node = child if n == len(child.key) else None
        return i

    def insert(self, key: list[int], slots: torch.Tensor, namespace: Hashable = None) -> int:
        """Hand the KV of `key` (slots [len(key)] int64) to the tree; return how many leading tokens
        were cached already.

        Every slot passed is the tree's afterwards: a slot already in the tree at its position is
        kept, one that duplicates a cached token (the same token computed twice) is freed, and the
        part past the cached prefix becomes a new leaf.
        """
        return self._insert(key, slots, namespace)[0]

    def insert_node(self, key: list[int], slots: torch.Tensor, namespace: Hashable = None) -> RadixNode:
        """`insert`, returning the node where `key` ends (what `match(key).node` would be next)."""
        return self._insert(key, slots, namespace)[1]

    def _insert(self, key: list[int], slots: torch.Tensor, namespace: Hashable) -> tuple[int, RadixNode]:
        assert len(key) == slots.numel(), f"insert: {len(key)} tokens but {slots.numel()} slots"
        node, i = self.root(namespace), 0
        now = next(self._clock)
        while i < len(key) and key[i] in node.children:
            child = node.children[key[i]]
            n = common_length(child.key, key[i:i + len(child.key)])
            if n < len(child.key):
                child = self._split(child, n)
            self._free_duplicates(slots[i:i + n], child.slots)
            child.last_access = now
            node, i = child, i + n
        if i == len(key):
            return i, node
        leaf = RadixNode(list(key[i:]), slots[i:].clone(), parent=node, last_access=now)
        node.children[key[i]] = leaf
        self.evictable_size += len(leaf.key)  # nobody references a new leaf yet
        self._offer(leaf)
        return i, leaf

    def _free_duplicates(self, given: torch.Tensor, cached: torch.Tensor) -> None:
        if self.free_slots is None or torch.equal(given, cached):  # the usual case: the request's own slots
            return
        if given.numel() <= _FEW_SLOTS:  # NOTE: two list reads beat a mask and its gather on a few slots
            self.free_slots(torch.tensor([g for g, c in zip(given.tolist(), cached.tolist()) if g != c],
                                         dtype=torch.int64))
            return
        self.free_slots(given[given != cached])

    def _split(self, child: RadixNode, n: int) -> RadixNode:
        """Cut `child`'s edge after n tokens: a new node takes the first n and becomes its parent.
        The new node carries child's references (a lock on child holds all its ancestors)."""
        parent = child.parent
        upper = RadixNode(child.key[:n], child.slots[:n], parent=parent, lock_ref=child.lock_ref,
                          last_access=child.last_access)
        upper.children[child.key[n]] = child
        parent.children[child.key[0]] = upper
        child.key, child.slots, child.parent = child.key[n:], child.slots[n:], upper
        return upper

    # -- references -----------------------------------------------------------------------------

    def lock(self, node: RadixNode) -> None:
        """A request uses the prefix ending at `node`: protect it and its ancestors from eviction."""
        while node.parent is not None:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        """Drop the reference taken by `lock(node)`."""
        while node.parent is not None:
            assert node.lock_ref > 0, "unlock of a node that is not locked"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.protected_size -= len(node.key)
                self.evictable_size += len(node.key)
                self._offer(node)
            node = node.parent

    # -- eviction -------------------------------------------------------------------------------

    def evict(self, num_slots: int) -> int:
        """Free unreferenced leaves, least recently used first, until `num_slots` slots are freed
        (a leaf is freed whole, so possibly more) or none is left; return the number freed."""
        freed = 0
        while freed < num_slots and self._heap:
            access, _, leaf = heapq.heappop(self._heap)
            if leaf.lock_ref or leaf.children:  # referenced or inner now: offered again once a free leaf
                leaf.in_heap = False
                continue
            if leaf.last_access != access:  # used since the push: back in at its last access
                heapq.heappush(self._heap, (leaf.last_access, next(self._pushes), leaf))
                continue
            leaf.in_heap = False
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            self.evictable_size -= len(leaf.key)
            freed += len(leaf.key)
            if self.free_slots is not None:
                self.free_slots(leaf.slots)
            self._offer(parent)
        return freed

    def _offer(self, node: RadixNode) -> None:
        """Push `node` to the eviction heap if it is an unreferenced leaf (not a root) without an entry."""
        if node.in_heap or node.lock_ref or node.children or node.parent is None:
            return
        node.in_heap = True
        heapq.heappush(self._heap, (node.last_access, next(self._pushes), node))

    def nodes(self):
        """Every non-root node, depth first."""
        stack = [c for r in self.roots.values() for c in r.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def all_slots(self) -> torch.Tensor:
        """Every slot the tree owns (tests and invariant checks)."""
        pieces = [n.slots for n in self.nodes()]
        return torch.cat(pieces) if pieces else _EMPTY
