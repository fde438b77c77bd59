"""The torch_native LoRA backend: plain matmuls, the reference every other LoRA backend is tested against.

Eager: a loop over the segments with host lengths (the clearest statement of the contract).
For a graph key (bound by init_metadata_for_capture / _for_replay), inside any CUDA graph capture,
or with graph_safe=True: a loop over the slots with per-token masks read from the batch info's
device buffers, whose shapes depend only on T and num_slots, so a replay with other segments (any
lengths at the key's token count: decode, verify and ragged extend keys alike) stays correct.
"""

from __future__ import annotations

from typing import Any

import torch

from backplane.contracts.lora import LoraBackend, LoraBackendContext
from backplane.contracts.lora_batch import LoraBatchInfo
from backplane.plugin.registry import LoraBackendSpec


class TorchNativeLoraBackend(LoraBackend):
    """Reference LoRA arithmetic in plain torch; works on any device and dtype.

    graph_safe: always use the slot-loop path (otherwise for graph keys and while a CUDA graph is
    captured).
    """

    def __init__(self, ctx: LoraBackendContext, graph_safe: bool = False) -> None:
        super().__init__(ctx)
        self.graph_safe = graph_safe
        self._graph_bound = False  # the batch info was bound for a graph key: the slot loop

    def prepare_batch(self, batch_info: LoraBatchInfo) -> None:
        self.batch_info, self._graph_bound = batch_info, False

    def init_metadata_for_capture(self, key: Any, batch_info: LoraBatchInfo) -> None:
        self.batch_info, self._graph_bound = batch_info, True

    def init_metadata_for_replay(self, key: Any, batch_info: LoraBatchInfo) -> None:
        self.batch_info, self._graph_bound = batch_info, True

    def lora_a(self, x: torch.Tensor, a_weights: torch.Tensor, num_slices: int = 1) -> torch.Tensor:
        # x: [T, K]; a_weights: [num_slots, num_slices * R_max, K]; y: [T, num_slices * R_max]
        r_max = a_weights.shape[1] // num_slices
        y = torch.zeros(x.shape[0], a_weights.shape[1], dtype=x.dtype, device=x.device)
        if self._use_slot_loop():
            for slot, token_mask, rank_mask in self._slot_masks(x.shape[0], r_max):
                y_slot = (x.float() @ a_weights[slot].float().T) * rank_mask.repeat(num_slices)
                y += (y_slot * token_mask[:, None]).to(x.dtype)
            return y
        for start, end, slot, rank in self._segments():
            rows = torch.arange(a_weights.shape[1], device=x.device) % r_max < rank
            y[start:end, rows] = (x[start:end].float() @ a_weights[slot, rows].float().T).to(x.dtype)
        return y

    def lora_b(self, x: torch.Tensor, b_weights: torch.Tensor, base_output: torch.Tensor) -> torch.Tensor:
        # x: [T, R_max]; b_weights: [num_slots, N, R_max]; base_output: [T, N] (updated in place)
        info = self._info()
        if self._use_slot_loop():
            delta = torch.zeros(base_output.shape, dtype=torch.float32, device=x.device)
            for slot, token_mask, rank_mask in self._slot_masks(x.shape[0], b_weights.shape[2]):
                x_slot = x.float() * rank_mask * token_mask[:, None]
                delta += (x_slot @ b_weights[slot].float().T) * info.scalings[slot]
            base_output.copy_(base_output.float() + delta)
            return base_output
        scalings = info.scalings_cpu.tolist()
        for start, end, slot, rank in self._segments():
            if rank == 0:
                continue
            update = x[start:end, :rank].float() @ b_weights[slot, :, :rank].float().T
            base_output[start:end] = base_output[start:end].float() + scalings[slot] * update
        return base_output

    def _info(self) -> LoraBatchInfo:
        if self.batch_info is None:
            raise RuntimeError("TorchNativeLoraBackend: call prepare_batch(batch_info) before the products")
        return self.batch_info

    def _use_slot_loop(self) -> bool:
        if self.graph_safe or self._graph_bound:
            return True
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()

    def _segments(self):
        """Yield (start, end, slot, rank) of every segment, from the host mirrors."""
        info = self._info()
        seg_lens = info.seg_lens_cpu[: info.bs].tolist()
        slots = info.weight_indices_cpu[: info.bs].tolist()
        ranks = info.ranks_cpu.tolist()
        start = 0
        for length, slot in zip(seg_lens, slots):
            yield start, start + length, slot, ranks[slot]
            start += length

    def _slot_masks(self, num_tokens: int, r_max: int):
        """Yield (slot, token_mask [T] bool, rank_mask [R_max] float32) from device tensors only."""
        info = self._info()
        device = info.device
        token_slot, covered = _token_slots(info, num_tokens)
        columns = torch.arange(r_max, device=device)
        for slot in range(info.num_slots):
            rank_mask = (columns < info.ranks[slot]).float()
            yield slot, (token_slot == slot) & covered, rank_mask


def _token_slots(info: LoraBatchInfo, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The slot of every token ([T] int) and whether a segment covers it ([T] bool), on the device."""
    tokens = torch.arange(num_tokens, device=info.device, dtype=torch.int32)
    # segment of token t: the number of segment ends <= t (unused segments end at num_tokens)
    segment = torch.searchsorted(info.seg_indptr[1:], tokens, right=True)
    covered = tokens < info.seg_indptr[-1]
    segment = segment.clamp(max=info.max_segments - 1)
    return info.weight_indices[segment], covered


def _make(ctx: LoraBackendContext) -> TorchNativeLoraBackend:
    return TorchNativeLoraBackend(ctx)


SPEC = LoraBackendSpec(
    name="torch_native",
    factory=_make,
    description="plain torch matmuls per segment; the reference (slow)",
    platforms=("cpu", "cuda"),
    supports_graph=True,
    graph_modes=("decode", "target_verify", "extend"),  # graph keys take the per-token slot loop
    priority=0,
)
