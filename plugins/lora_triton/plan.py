"""Host-side planning for the Triton LoRA kernels: group tokens by slot and cut them into tiles.

The kernels run one program per (tile, column block). A tile is up to BLOCK_M tokens that all use
one adapter slot, so each program reads its slot's weights once. Tokens are grouped by slot through
a permutation, so segments that share a slot (say, four requests on one adapter that are not
neighbours in the batch) share tiles too.

Device layout of the plan, in one int32 buffer with fixed capacity (graph-safe):
  tiles: [max_tiles, 3] = (slot, first position in perm, number of tokens); unused tiles have 0 tokens
  perm:  [max_tokens], perm[p] = the token (row of x) at position p of the slot-grouped order
For T tokens at most cdiv(T, BLOCK_M) + num_slots tiles are needed, whatever the segments are, so a
launch grid of that size depends only on T and the graph key.
"""

from __future__ import annotations

import torch

from backplane.lora import LoraBatchInfo

MIN_BLOCK_M = 16  # tl.dot needs at least 16 rows
MAX_SHRINK_COL_BLOCKS = 16  # split-K locks per tile; a shrink with more column blocks does not split


def max_tiles(num_tokens: int, num_slots: int, block_m: int) -> int:
    """The most tiles `num_tokens` tokens can need, however they are split among `num_slots` slots."""
    return -(-num_tokens // block_m) + num_slots


class TilePlan:
    """Fixed host and device buffers for the tiles and the permutation, rewritten per batch."""

    def __init__(self, device: torch.device, max_tokens: int, num_slots: int) -> None:
        self.device = torch.device(device)
        self.max_tokens = max_tokens
        self.num_slots = num_slots
        self.max_tiles = max_tiles(max_tokens, num_slots, MIN_BLOCK_M)
        size = 3 * self.max_tiles + max_tokens
        self._staging = torch.zeros(size, dtype=torch.int32)
        self._buffer = torch.zeros(size, dtype=torch.int32, device=self.device)
        self.tiles = self._buffer[: 3 * self.max_tiles]  # [max_tiles * 3]
        self.perm = self._buffer[3 * self.max_tiles :]  # [max_tokens]
        # the shrink kernel's split-K locks: always zero between launches
        self.locks = torch.zeros(self.max_tiles * MAX_SHRINK_COL_BLOCKS, dtype=torch.int32, device=self.device)
        self.block_m = MIN_BLOCK_M
        self.num_tiles = 0

    def fits(self, num_tokens: int, num_slots: int) -> bool:
        return num_tokens <= self.max_tokens and num_slots <= self.num_slots

    def update_(self, info: LoraBatchInfo, block_m: int) -> None:
        """Plan `info`'s segments with tiles of `block_m` tokens and copy the plan to the device."""
        if block_m < MIN_BLOCK_M or not self.fits(info.num_tokens, info.num_slots):
            raise ValueError(
                f"TilePlan.update_: expected block_m >= {MIN_BLOCK_M}, <= {self.max_tokens} tokens and "
                f"<= {self.num_slots} slots, got block_m={block_m}, {info.num_tokens} tokens, "
                f"{info.num_slots} slots"
            )
        tiles, perm = plan_tiles(info, block_m)
        num_tiles = len(tiles) // 3
        staging = self._staging
        staging[3 * num_tiles : 3 * max(num_tiles, self.num_tiles)] = 0  # retire the old tiles
        if num_tiles:
            staging[: 3 * num_tiles] = torch.tensor(tiles, dtype=torch.int32)
        num_tokens = int(perm.shape[0])
        perm_start = 3 * self.max_tiles
        staging[perm_start : perm_start + num_tokens] = perm
        end = perm_start + num_tokens
        # NOTE: a pageable source is staged before copy_ returns; non_blocking avoids a sync.
        self._buffer[:end].copy_(staging[:end], non_blocking=True)
        self.block_m = block_m
        self.num_tiles = num_tiles


def plan_tiles(info: LoraBatchInfo, block_m: int) -> tuple[list[int], torch.Tensor]:
    """Tiles (flat list of (slot, start, length) triples) and perm ([num_tokens] int32) for `info`.

    Slots are taken in order of first appearance; inside a slot, tokens keep their batch order.
    """
    seg_lens = info.seg_lens_cpu[: info.bs].tolist()
    slots = info.weight_indices_cpu[: info.bs].tolist()
    segments_of_slot: dict[int, list[int]] = {}
    for index, (length, slot) in enumerate(zip(seg_lens, slots)):
        if length:
            segments_of_slot.setdefault(slot, []).append(index)
    order = [index for indices in segments_of_slot.values() for index in indices]
    tiles: list[int] = []
    position = 0
    for slot, indices in segments_of_slot.items():
        count = sum(seg_lens[i] for i in indices)
        for offset in range(0, count, block_m):
            tiles += (slot, position + offset, min(block_m, count - offset))
        position += count
    return tiles, _permutation(seg_lens, order)


def _permutation(seg_lens: list[int], order: list[int]) -> torch.Tensor:
    """perm [num_tokens] int32 that lists the segments' tokens in `order` (indices into seg_lens)."""
    starts = [0] * len(seg_lens)
    for i in range(1, len(seg_lens)):
        starts[i] = starts[i - 1] + seg_lens[i - 1]
    num_tokens = sum(seg_lens)
    if order == sorted(order):  # already grouped: the identity
        return torch.arange(num_tokens, dtype=torch.int32)
    lens = torch.tensor([seg_lens[i] for i in order], dtype=torch.int64)
    new_starts = torch.cumsum(lens, 0) - lens
    shift = torch.tensor([starts[i] for i in order], dtype=torch.int64) - new_starts
    perm = torch.arange(num_tokens, dtype=torch.int64) + torch.repeat_interleave(shift, lens)
    return perm.to(torch.int32)
