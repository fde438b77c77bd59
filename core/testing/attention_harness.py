"""What the attention conformance suites share: tolerances, a case, a harness of real pools, and
the world of random ragged EXTEND batches the extend graph cases replay.

Used by `attention_conformance` (eager cases) and `graph_conformance` (graph replay, compile), so
neither imports the other.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from backplane.contracts.attention import AttentionBackendContext, AttentionLayerInfo
from backplane.contracts.batch import ForwardBatch, ForwardMode
from backplane.contracts.memory import ReqToTokenPool, TokenToKVPool

TOLERANCE = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@dataclass(frozen=True)
class Case:
    """One conformance check. prefix/new: per-request cached and new token counts."""

    name: str
    mode: str
    prefix: tuple[int, ...]
    new: tuple[int, ...]
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    window: int = 0
    softcap: float = 0.0
    tree_mask: bool = False

    def __str__(self) -> str:
        return self.name


class Harness:
    """Real pools holding random prefixes at random slots, and batches over them."""

    def __init__(self, case: Case, dtype: torch.dtype, device: str, seed: int, num_layers: int = 1):
        self.case, self.dtype, self.device = case, dtype, torch.device(device)
        self.gen = torch.Generator().manual_seed(seed)
        total = sum(case.prefix) + sum(case.new)
        max_ctx = max(p + n for p, n in zip(case.prefix, case.new)) + 1
        self.req_pool = ReqToTokenPool(len(case.prefix) + 1, max_ctx, device)
        self.kv_pool = TokenToKVPool(total + 16, num_layers, case.num_kv_heads, case.head_dim, dtype, device)
        self.rng = random.Random(seed)
        slots = list(range(1, total + 17))
        self.rng.shuffle(slots)  # random slot order, never slot 0
        self.free_slots = slots
        self.rows = [self.req_pool.alloc() for _ in case.prefix]
        for layer in range(num_layers):
            for buf in (*self.kv_pool.get_kv_buffer(layer),):
                buf.copy_(self.randn(*buf.shape))
        for row, p in zip(self.rows, case.prefix):
            self._place(row, 0, p)

    def randn(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(self.device, self.dtype)

    def _place(self, row: int, start: int, n: int) -> torch.Tensor:
        slots = torch.tensor([self.free_slots.pop() for _ in range(n)], dtype=torch.int64)
        self.req_pool.req_to_token[row, start:start + n] = slots.to(self.device, torch.int32)
        return slots

    def batch(self) -> ForwardBatch:
        c = self.case
        mode = ForwardMode(c.mode)
        locs = [self._place(row, p, n) for row, p, n in zip(self.rows, c.prefix, c.new)]
        seq = [p + n for p, n in zip(c.prefix, c.new)]
        positions = [pos for p, n in zip(c.prefix, c.new) for pos in range(p, p + n)]
        dev = self.device
        batch = ForwardBatch(
            forward_mode=mode, batch_size=len(seq), input_ids=torch.zeros(sum(c.new), dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, device=dev), req_pool_indices=torch.tensor(self.rows, device=dev),
            seq_lens=torch.tensor(seq, dtype=torch.int32, device=dev), seq_lens_cpu=torch.tensor(seq, dtype=torch.int32),
            out_cache_loc=torch.cat(locs).to(dev), req_to_token_pool=self.req_pool, token_to_kv_pool=self.kv_pool,
        )
        if mode is not ForwardMode.DECODE:
            batch.set_extend_lens(c.prefix, c.new)
        if c.tree_mask:
            batch.custom_mask, batch.mask_indptr = self.tree_mask()
        return batch

    def tree_mask(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A random draft tree per request: each node sees the prefix, itself and its ancestors."""
        masks, indptr = [], [0]
        for p, n in zip(self.case.prefix, self.case.new):
            parent = [-1] + [self.rng.randrange(0, i) for i in range(1, n)]
            m = torch.zeros(n, p + n, dtype=torch.bool)
            m[:, :p] = True
            for i in range(n):
                j = i
                while j >= 0:
                    m[i, p + j] = True
                    j = parent[j]
            masks.append(m.flatten())
            indptr.append(indptr[-1] + m.numel())
        return torch.cat(masks).to(self.device), torch.tensor(indptr, dtype=torch.int32, device=self.device)

    def context(self, options=None) -> AttentionBackendContext:
        c = self.case
        return AttentionBackendContext(
            num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
            num_layers=self.kv_pool.num_layers, dtype=self.dtype, device=self.device,
            req_to_token_pool=self.req_pool, token_to_kv_pool=self.kv_pool,
            max_context_len=self.req_pool.max_context_len, options=options)

    def layer(self) -> AttentionLayerInfo:
        c = self.case
        return AttentionLayerInfo(0, c.num_heads, c.num_kv_heads, c.head_dim, c.head_dim ** -0.5,
                                  sliding_window=c.window, logit_softcap=c.softcap)


class ExtendWorld:
    """Requests whose pool rows hold `max_len` placed slots of random K/V; each step extends a
    random subset over random cached prefixes (about a third of them none), with different new
    token counts, as EXTEND batches of prefill, chunked prefill and extend over a cached prefix.
    `pad_row` is an all-zero request row (its tokens read and write the dump slot 0)."""

    def __init__(self, num_reqs: int, max_len: int, dtype, seed: int, device: str, window: int = 0,
                 softcap: float = 0.0, num_heads: int = 8, num_kv_heads: int = 2, head_dim: int = 64):
        case = Case("extend-graph", "extend", (max_len,) * num_reqs, (0,) * num_reqs, num_heads=num_heads,
                    num_kv_heads=num_kv_heads, head_dim=head_dim, window=window, softcap=softcap)
        self.h = Harness(case, dtype, device, seed)
        self.rng, self.max_len = random.Random(seed), max_len
        self.pad_row = self.h.req_pool.alloc()
        self.h.req_pool.req_to_token[self.pad_row].zero_()

    def batch(self, new: list[int]) -> ForwardBatch:
        """An EXTEND batch of len(new) distinct random requests with new[i] new tokens each."""
        rows = self.rng.sample(self.h.rows, len(new))
        prefix = [0 if self.rng.random() < 1 / 3 else self.rng.randint(1, self.max_len - n) for n in new]
        r2t = self.h.req_pool.req_to_token.cpu()
        locs = torch.cat([r2t[row, p:p + n].long() for row, p, n in zip(rows, prefix, new)])
        positions = [pos for p, n in zip(prefix, new) for pos in range(p, p + n)]
        seq = [p + n for p, n in zip(prefix, new)]
        dev = self.h.device
        batch = ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=len(new),
            input_ids=torch.zeros(sum(new), dtype=torch.int64, device=dev), positions=torch.tensor(positions, device=dev),
            req_pool_indices=torch.tensor(rows, device=dev), seq_lens=torch.tensor(seq, dtype=torch.int32, device=dev),
            seq_lens_cpu=torch.tensor(seq, dtype=torch.int32), out_cache_loc=locs.to(dev),
            req_to_token_pool=self.h.req_pool, token_to_kv_pool=self.h.kv_pool)
        batch.set_extend_lens(prefix, new)
        return batch

    def split(self, num_tokens: int, num_reqs: int) -> list[int]:
        """A random composition of `num_tokens` into `num_reqs` positive new-token counts."""
        cuts = sorted(self.rng.sample(range(1, num_tokens), num_reqs - 1))
        return [b - a for a, b in zip([0] + cuts, cuts + [num_tokens])]
