"""The LoraBackend contract: the arithmetic of batched multi-adapter LoRA, nothing else.

For a linear layer y = x W^T, LoRA adds, per token, scaling[slot] * (x A^T) B^T, where the token's
segment picks the adapter slot. The core owns adapters (loading, the slot pool, stacking their
weights into fixed per-slot buffers) and the wrapping of linear layers; a backend owns only the
segmented products below.

Weight layout (built by the core, one buffer per projection, slot-major):
  A: [num_slots, num_slices * R_max, K]   rows j*R_max + r of slice j; zero for r >= rank[slot]
  B: [num_slots, N, R_max]                columns r >= rank[slot] are ignored (masked)
Slices: q, k, v share one stacked A (num_slices=3) and one stacked B of N = N_q + 2 * N_kv;
gate and up share A (num_slices=2) and B of N = 2 * N_inter; every other projection has one slice.

Call order for one forward pass:
    backend.prepare_batch(batch_info)                        # once, before the first layer
    y = backend.lora_a(x, A, num_slices)                     # per projection: shrink
    backend.lora_b(y, B, base_output)                        # expand, added in place
    backend.qkv_lora_b(y, B_qkv, output_offsets, base_output)  # or the fused q,k,v expand
    backend.gate_up_lora_b(y, B_gate_up, base_output)        # or the fused gate,up expand
Under CUDA graphs:
    backend.init_graph_state(max_bs, max_num_tokens)         # once, allocate static buffers
    backend.init_metadata_for_capture(key, batch_info)       # instead of prepare_batch, then capture
    backend.init_metadata_for_replay(key, batch_info)        # refresh static buffers, then replay
A kernel launched inside a graph must not depend on host values that change between replays
(number of segments, their lengths, max_len): only on tensor shapes and on the graph key.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from backplane.contracts.lora_batch import LoraBatchInfo


@dataclass
class LoraBackendContext:
    """Everything a LoRA backend factory receives.

    max_loras_per_batch: adapter slots besides the base-only slot 0 (num_slots = this + 1).
    max_lora_rank: R_max, the padded rank of every stacked weight buffer.
    max_bs / max_num_tokens: the most segments and tokens one forward pass can have.
    options: the plugin's settings group (a pydantic model), if it registered one.
    """

    device: torch.device
    dtype: torch.dtype
    max_loras_per_batch: int
    max_lora_rank: int
    max_bs: int
    max_num_tokens: int
    options: Any = None

    @property
    def num_slots(self) -> int:
        return self.max_loras_per_batch + 1


class LoraBackend(ABC):
    """Base class of every LoRA backend.

    Tensors, with T = the number of tokens of the forward pass (>= batch_info.num_tokens):
      x: [T, K] activations (float32, float16 or bfloat16), row t belongs to the segment of token t
      base_output: [T, N], the base layer's output, updated in place (any row stride, unit column stride)
    Only rows covered by a segment are computed or updated; other rows of a shrink result are
    unspecified and other rows of base_output are left untouched. A token whose slot has rank 0
    (the base-only slot) gets exactly the base output.
    """

    def __init__(self, ctx: LoraBackendContext) -> None:
        self.ctx = ctx
        self.batch_info: LoraBatchInfo | None = None

    @abstractmethod
    def prepare_batch(self, batch_info: LoraBatchInfo) -> None:
        """Plan one eager forward pass from `batch_info`; called once before the first layer.

        The backend keeps a reference to `batch_info` (its device buffers are read by the kernels)
        and may plan on the host from its host mirrors.
        """

    @abstractmethod
    def lora_a(self, x: torch.Tensor, a_weights: torch.Tensor, num_slices: int = 1) -> torch.Tensor:
        """Shrink: y[t] = x[t] @ A[slot(t)]^T for every covered token.

        x: [T, K]; a_weights: [num_slots, num_slices * R_max, K] (see the module docstring).
        Returns y: [T, num_slices * R_max]; columns j*R_max + r with r >= rank[slot] are zero.
        y's dtype is the backend's choice (x.dtype or float32); pass it unchanged to the lora_b
        methods.
        """

    @abstractmethod
    def lora_b(self, x: torch.Tensor, b_weights: torch.Tensor, base_output: torch.Tensor) -> torch.Tensor:
        """Expand: base_output[t] += scaling[slot] * x[t, :rank] @ B[slot, :, :rank]^T, in place.

        x: [T, R_max] (a shrink result); b_weights: [num_slots, N, R_max]; base_output: [T, N].
        Returns base_output.
        """

    def qkv_lora_b(
        self,
        x: torch.Tensor,
        qkv_b_weights: torch.Tensor,
        output_offsets: Sequence[int] | torch.Tensor,
        base_output: torch.Tensor,
    ) -> torch.Tensor:
        """Fused q, k, v expand: slice j of x goes to columns [offsets[j], offsets[j+1]).

        x: [T, 3 * R_max] (the stacked shrink result); qkv_b_weights: [num_slots, N_q + 2*N_kv, R_max];
        output_offsets: 4 increasing host ints (0, N_q, N_q + N_kv, N_q + 2*N_kv) -- a CPU tensor or
        a list (a device tensor is read with a synchronisation, so never inside a graph capture);
        base_output: [T, N_q + 2*N_kv]. Returns base_output.
        The default runs `lora_b` on each slice; backends may fuse.
        """
        offsets = host_offsets(output_offsets, num_slices=3, width=qkv_b_weights.shape[1])
        self._sliced_lora_b(x, qkv_b_weights, offsets, base_output)
        return base_output

    def gate_up_lora_b(
        self, x: torch.Tensor, gate_up_b_weights: torch.Tensor, base_output: torch.Tensor
    ) -> torch.Tensor:
        """Fused gate, up expand: x [T, 2 * R_max], B [num_slots, 2 * N_inter, R_max] into
        base_output [T, 2 * N_inter] (gate in the first half, up in the second). Returns base_output.
        """
        n_inter = gate_up_b_weights.shape[1] // 2
        self._sliced_lora_b(x, gate_up_b_weights, (0, n_inter, 2 * n_inter), base_output)
        return base_output

    def apply_lora(
        self,
        x: torch.Tensor,
        a_weights: torch.Tensor,
        b_weights: torch.Tensor,
        output_offsets: Sequence[int],
        base_output: torch.Tensor,
    ) -> torch.Tensor:
        """One projection's whole LoRA delta, shrink and expand, in place into base_output.

        For each slice j: base_output[:, offsets[j]:offsets[j+1]] += scaling[slot] * (x A_j^T) B_j^T,
        with A_j = a_weights[slot, j*R_max : j*R_max + rank] and B_j its rows of b_weights.
        x: [T, K]; a_weights: [num_slots, num_slices * R_max, K]; b_weights: [num_slots, N, R_max];
        output_offsets: num_slices + 1 host ints from 0 to N; base_output: [T, N]. Returns base_output.
        The default is `lora_a` then the matching expand; backends may fuse both into one kernel.
        """
        offsets = tuple(int(v) for v in output_offsets)
        shrunk = self.lora_a(x, a_weights, len(offsets) - 1)
        return self._expand_slices(shrunk, b_weights, offsets, base_output)

    def _expand_slices(self, shrunk: torch.Tensor, b_weights: torch.Tensor, offsets: tuple[int, ...],
                       base_output: torch.Tensor) -> torch.Tensor:
        """The expand matching the slices of `offsets` (fused q/k/v or gate/up where they fit)."""
        num_slices = len(offsets) - 1
        if num_slices == 3:
            return self.qkv_lora_b(shrunk, b_weights, offsets, base_output)
        if num_slices == 2 and offsets[2] == 2 * offsets[1]:
            return self.gate_up_lora_b(shrunk, b_weights, base_output)
        if num_slices == 1:
            return self.lora_b(shrunk, b_weights, base_output)
        self._sliced_lora_b(shrunk, b_weights, offsets, base_output)
        return base_output

    # -- the shrink folded into the base GEMM (opt-in) ------------------------------------------
    #: A backend that sets this (class or instance) gets, for batches where `folds(num_tokens)` is
    #: true, one GEMM with every slot's A stacked under the base weight, and `expand_folded` to finish.
    folds_shrink: bool = False

    def folds(self, num_tokens: int) -> bool:
        """Whether a pass of `num_tokens` tokens takes the folded path (only asked when folds_shrink)."""
        return self.folds_shrink

    def expand_folded(
        self,
        y: torch.Tensor,
        num_base: int,
        b_weights: torch.Tensor,
        output_offsets: Sequence[int],
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Finish a folded pass: out[t] = y[t, :N] + the LoRA delta of token t, written into `out`.

        y: [T, N + num_slots * num_slices * R_max] = x @ [W; A]^T, the base GEMM over the weight with
        every slot's stacked A (the layout of the module docstring, slot-major) under it: columns
        N + slot * num_slices * R_max + j * R_max + r hold token t's shrink x A_j^T for that slot.
        num_base: N; b_weights: [num_slots, N, R_max]; output_offsets: num_slices + 1 host ints from
        0 to N; out: [T, N], contiguous. Token t uses the slot batch_info.token_slots[t] (0 for
        padding and base-only requests, whose A rows are zero). Returns out.
        The default gathers each token's own shrink and runs this backend's expand on it; backends
        fuse both into one kernel.
        """
        offsets = tuple(int(v) for v in output_offsets)
        num_slots, _, r_max = b_weights.shape
        num_tokens, width = y.shape[0], (len(offsets) - 1) * r_max
        slots = self.batch_info.token_slots[:num_tokens].long()
        shrunk = y[:, num_base:].view(num_tokens, num_slots, width)[torch.arange(num_tokens, device=y.device), slots]
        out.copy_(y[:, :num_base])
        return self._expand_slices(shrunk, b_weights, offsets, out)

    def init_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate the static buffers that captured graphs read; called once before capture."""

    def init_metadata_for_capture(self, key: Any, batch_info: LoraBatchInfo) -> None:
        """Bind graph `key` to the static buffers for `batch_info`, before the graph is captured."""
        self.prepare_batch(batch_info)

    def init_metadata_for_replay(self, key: Any, batch_info: LoraBatchInfo) -> None:
        """Refresh, in place, the static buffers that graph `key` reads, before it is replayed."""
        self.prepare_batch(batch_info)

    def _sliced_lora_b(
        self, x: torch.Tensor, b_weights: torch.Tensor, offsets: Sequence[int], base_output: torch.Tensor
    ) -> None:
        r_max = b_weights.shape[2]
        for j in range(len(offsets) - 1):
            lo, hi = offsets[j], offsets[j + 1]
            self.lora_b(x[:, j * r_max : (j + 1) * r_max], b_weights[:, lo:hi], base_output[:, lo:hi])


def host_offsets(output_offsets: Sequence[int] | torch.Tensor, num_slices: int, width: int) -> tuple[int, ...]:
    """Validate fused-output offsets and return them as host ints.

    Expected: num_slices + 1 increasing ints starting at 0 and ending at `width` (the fused N).
    """
    if isinstance(output_offsets, torch.Tensor):
        output_offsets = output_offsets.tolist()
    offsets = tuple(int(v) for v in output_offsets)
    increasing = all(a < b for a, b in zip(offsets, offsets[1:]))
    if len(offsets) != num_slices + 1 or offsets[0] != 0 or offsets[-1] != width or not increasing:
        raise ValueError(
            f"output_offsets: expected {num_slices + 1} increasing ints from 0 to {width} "
            f"(the fused output width), got {list(offsets)}"
        )
    return offsets
