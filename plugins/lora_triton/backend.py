"""TritonLoraBackend: the LoraBackend contract on the segmented-GEMM kernels of kernels.py.

Decode-sized batches (at most FUSED_MAX_TOKENS tokens) run `apply_lora` as one fused
shrink-and-expand launch per projection group (fused.py), which reads the batch info's persistent
per-token slots and needs no host plan. Larger batches, and the separate products (lora_a / lora_b,
which tensor-parallel row layers need), use the segmented kernels: prepare_batch plans tiles on the
host (plan.py) into fixed buffers, lazily for decode-sized batches; each product is one launch
whose grid depends only on tensor shapes and the tile height chosen for the graph key, so the same
code path serves eager runs, graph capture and replay. A graph re-plans at replay only when its
capture used the separate products.

Extend graphs (ragged keys: segments of any lengths, a padded one on slot 0, at the bucket's fixed
token count) need nothing more: the fused and folded kernels read the per-token slots on the
device, and the segmented kernels' grid is max_tiles(T, num_slots, BLOCK_M), the most tiles any
split of T tokens among the slots can need, with the tiles past the batch's exiting at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import triton

from backplane.lora import LoraBackend, LoraBackendContext, host_offsets
from backplane.lora import LoraBatchInfo
from backplane.plugins.lora_triton import folded, fused, kernels, tuned
from backplane.plugins.lora_triton.fused import FUSED_MAX_TOKENS, MAX_GROUPS, FusedBuffers, FusedConfig
from backplane.plugins.lora_triton.options import TritonLoraOptions
from backplane.plugins.lora_triton.plan import MAX_SHRINK_COL_BLOCKS, TilePlan, max_tiles


@dataclass(frozen=True)
class Tuning:
    """Overrides of the launch heuristics (None: automatic). For benchmarks and tests."""

    block_m: int | None = None
    shrink_block_k: int | None = None
    shrink_split_k: int | None = None
    expand_block_n: int | None = None
    fused_config: FusedConfig = FusedConfig()  # set: every fused launch uses it, over the tuned table
    fused_max_tokens: int = FUSED_MAX_TOKENS  # 0: never fuse


def choose_block_m(num_tokens: int) -> int:
    """Tokens per tile: small for decode (a few tokens per adapter), larger for prefill."""
    if num_tokens <= 128:
        return 16
    return 32 if num_tokens <= 1024 else 64


def _pow2_between(value: int, low: int, high: int) -> int:
    return max(low, min(high, triton.next_power_of_2(value)))


class TritonLoraBackend(LoraBackend):
    """Segmented multi-adapter LoRA in Triton. The shrink returns float32 [T, num_slices * R_max]."""

    def __init__(self, ctx: LoraBackendContext, tuning: Tuning | None = None) -> None:
        super().__init__(ctx)
        self.tuning = tuning or Tuning()
        self._plan = TilePlan(ctx.device, max(ctx.max_num_tokens, 1), ctx.num_slots)
        self._graph_block_m: dict[Any, int] = {}
        self._has_graph_state = False
        self._planned = False  # whether the tile plan describes self.batch_info
        self._graph_key: Any = None  # the graph whose metadata was bound last
        self._split_keys: set[Any] = set()  # graphs whose capture ran the separate products
        self._fused_buffers: list[FusedBuffers] = []  # the last one is used; older ones stay alive
        options = ctx.options or TritonLoraOptions()  # the defaults live in the options model only
        use_table = options.tuned and self.tuning.fused_config == FusedConfig()
        self.tuned = tuned.table_for(ctx.device, options.configs, MAX_GROUPS) if use_table \
            else tuned.TunedTable()
        self._launch_configs: dict[tuple, FusedConfig] = {}
        # --triton-lora.decode-path folded (the default): the core stacks A under the base weight for decode batches
        self.folds_shrink = options.decode_path == "folded"

    def _fuses(self, num_tokens: int) -> bool:
        return num_tokens <= min(self.tuning.fused_max_tokens, FUSED_MAX_TOKENS)

    def folds(self, num_tokens: int) -> bool:
        """The folded path takes the decode-sized batches the fused kernel would (see folded.py)."""
        return self.folds_shrink and self._fuses(num_tokens)

    def expand_folded(self, y: torch.Tensor, num_base: int, b_weights: torch.Tensor,
                      output_offsets: Sequence[int], out: torch.Tensor) -> torch.Tensor:
        info = self.batch_info
        if info is None:
            raise RuntimeError("TritonLoraBackend.expand_folded: no batch prepared (prepare_batch or a graph's metadata)")
        return folded.folded_expand(y, num_base, b_weights, output_offsets, out, info.token_slots, info.scalings)

    # ---- planning -------------------------------------------------------------------------
    def prepare_batch(self, batch_info: LoraBatchInfo) -> None:
        self._graph_key = None
        if self._fuses(batch_info.num_tokens):  # planned on first use of the separate products
            self.batch_info, self._planned = batch_info, False
            return
        self._bind(batch_info, self.tuning.block_m or choose_block_m(batch_info.num_tokens))

    def init_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        num_slots = max(self.ctx.num_slots, self._plan.num_slots)
        if not self._plan.fits(max_num_tokens, num_slots):
            self._plan = TilePlan(self.ctx.device, max_num_tokens, num_slots)
        self._has_graph_state = True  # from now on the plan buffers never move

    def init_metadata_for_capture(self, key: Any, batch_info: LoraBatchInfo) -> None:
        block_m = self.tuning.block_m or choose_block_m(batch_info.num_tokens)
        self._graph_block_m[key] = block_m
        self._bind(batch_info, block_m)  # always: the capture may run the separate products
        self._graph_key = key

    def init_metadata_for_replay(self, key: Any, batch_info: LoraBatchInfo) -> None:
        if key not in self._graph_block_m:
            raise KeyError(f"TritonLoraBackend: graph {key!r} was never captured (call init_metadata_for_capture)")
        self._graph_key = key
        if key in self._split_keys or not self._fuses(batch_info.num_tokens):
            self._bind(batch_info, self._graph_block_m[key])
        else:  # the graph's fused kernels read batch_info's device buffers: nothing to plan
            self.batch_info, self._planned = batch_info, False

    def _bind(self, info: LoraBatchInfo, block_m: int) -> None:
        if not self._plan.fits(info.num_tokens, info.num_slots):
            if self._has_graph_state:
                raise ValueError(
                    f"TritonLoraBackend: expected at most {self._plan.max_tokens} tokens and "
                    f"{self._plan.num_slots} slots (init_graph_state), got {info.num_tokens} and {info.num_slots}"
                )
            tokens = max(info.num_tokens, self._plan.max_tokens)
            self._plan = TilePlan(self.ctx.device, tokens, max(info.num_slots, self._plan.num_slots))
        self._plan.update_(info, block_m)
        self.batch_info, self._planned = info, True

    # ---- fused shrink and expand (decode) -------------------------------------------------
    def apply_lora(
        self,
        x: torch.Tensor,
        a_weights: torch.Tensor,
        b_weights: torch.Tensor,
        output_offsets: Sequence[int],
        base_output: torch.Tensor,
    ) -> torch.Tensor:
        info = self.batch_info
        if info is None or not self._fuses(x.shape[0]):
            return super().apply_lora(x, a_weights, b_weights, output_offsets, base_output)
        offsets = host_offsets(output_offsets, len(output_offsets) - 1, b_weights.shape[1])
        _check_fused_shapes(x, a_weights, b_weights, base_output, len(offsets) - 1)
        if b_weights.shape[0] > info.num_slots:
            raise ValueError(f"apply_lora: expected weights for at most {info.num_slots} slots (the batch "
                             f"info's), got {b_weights.shape[0]}")
        buffers = self._buffers_for(b_weights.shape[0], b_weights.shape[2], x.device)
        config = self.fused_config_for(x.shape, b_weights.shape[2], offsets)
        return fused.fused_shrink_expand(x, a_weights, b_weights, base_output, info.token_slots, info.ranks,
                                         info.scalings, list(offsets), buffers, config)

    def fused_config_for(self, x_shape: Sequence[int], r_max: int, offsets: Sequence[int]) -> FusedConfig:
        """The fused launch's settings: Tuning's if set, else the tuned table's entry for this shape,
        else automatic (the read model in fused.choose_split)."""
        num_tokens, k = int(x_shape[0]), int(x_shape[1])
        key = (num_tokens, k, r_max, tuple(offsets))
        config = self._launch_configs.get(key)
        if config is None:
            config = self.tuning.fused_config
            widths = tuple(hi - lo for lo, hi in zip(offsets, offsets[1:]))
            block_t, block_r = fused.tile_sizes(num_tokens, r_max)
            found = self.tuned.lookup(k, widths, block_r, block_t)
            if found is not None and config == FusedConfig():
                config = FusedConfig(span=found.span, split_k=found.split_k, num_warps=found.num_warps)
            self._launch_configs[key] = config
        return config

    def _buffers_for(self, num_slots: int, r_max: int, device: torch.device) -> FusedBuffers:
        """The fused kernel's workspace and locks; a larger set is made outside graph captures only,
        and the old one is kept (captured graphs may read it)."""
        if self._fused_buffers and self._fused_buffers[-1].fits(num_slots, r_max):
            return self._fused_buffers[-1]
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("TritonLoraBackend: the fused kernel's buffers must exist before a graph capture "
                               "(run the captured body once first)")
        self._fused_buffers.append(FusedBuffers.allocate(device, max(num_slots, self.ctx.num_slots),
                                                         max(r_max, self.ctx.max_lora_rank)))
        return self._fused_buffers[-1]

    # ---- products -------------------------------------------------------------------------
    def lora_a(self, x: torch.Tensor, a_weights: torch.Tensor, num_slices: int = 1) -> torch.Tensor:
        info, num_tiles = self._launch_bounds(x)
        num_tokens, k = x.shape
        n_out = a_weights.shape[1]
        if a_weights.shape[2] != k or n_out % num_slices:
            raise ValueError(
                f"lora_a: expected a_weights [num_slots, num_slices({num_slices}) * R_max, K={k}], "
                f"got {list(a_weights.shape)}"
            )
        r_max = n_out // num_slices
        block_n = _pow2_between(r_max, 16, 64)
        block_k, split_k = self._shrink_k_blocks(num_tokens, k)
        if triton.cdiv(n_out, block_n) > MAX_SHRINK_COL_BLOCKS:
            split_k = 1  # more column blocks than split-K locks per tile
        # y: [T, num_slices * R_max] float32
        return kernels.shrink(
            x, a_weights, self._plan.tiles, self._plan.perm, info.ranks, self._plan.locks, num_tiles,
            r_max, block_m=self._plan.block_m, block_n=block_n, block_k=block_k, split_k=split_k,
        )  # fmt: skip

    def lora_b(self, x: torch.Tensor, b_weights: torch.Tensor, base_output: torch.Tensor) -> torch.Tensor:
        return self._expand(x, b_weights, base_output, (0, b_weights.shape[1]))

    def qkv_lora_b(
        self,
        x: torch.Tensor,
        qkv_b_weights: torch.Tensor,
        output_offsets: Sequence[int] | torch.Tensor,
        base_output: torch.Tensor,
    ) -> torch.Tensor:
        offsets = host_offsets(output_offsets, num_slices=3, width=qkv_b_weights.shape[1])
        return self._expand(x, qkv_b_weights, base_output, offsets)

    def gate_up_lora_b(
        self, x: torch.Tensor, gate_up_b_weights: torch.Tensor, base_output: torch.Tensor
    ) -> torch.Tensor:
        n_inter = gate_up_b_weights.shape[1] // 2
        return self._expand(x, gate_up_b_weights, base_output, (0, n_inter, 2 * n_inter))

    def _expand(
        self, x: torch.Tensor, b_weights: torch.Tensor, base_output: torch.Tensor, offsets: tuple[int, ...]
    ) -> torch.Tensor:
        info, num_tiles = self._launch_bounds(x)
        num_slices, r_max = len(offsets) - 1, b_weights.shape[2]
        width = offsets[-1]
        shapes_ok = x.shape[1] == num_slices * r_max and b_weights.shape[1] == width
        if not shapes_ok or base_output.shape != (x.shape[0], width):
            raise ValueError(
                f"lora_b: expected x [T, {num_slices} * R_max], b_weights [num_slots, N={width}, R_max] and "
                f"base_output [T, N], got {list(x.shape)}, {list(b_weights.shape)}, {list(base_output.shape)}"
            )
        num_tokens = x.shape[0]
        block_n = self.tuning.expand_block_n or (64 if num_tokens <= 256 else 128)
        kernels.expand(
            x, b_weights, base_output, self._plan.tiles, self._plan.perm, info.ranks, info.scalings,
            num_tiles, offsets, block_m=self._plan.block_m, block_n=block_n,
            block_k=_pow2_between(r_max, 16, 64),
        )  # fmt: skip
        return base_output

    def _launch_bounds(self, x: torch.Tensor) -> tuple[LoraBatchInfo, int]:
        """The batch info and the tile grid size for x [T, *]: it depends on T and the graph key only."""
        info = self.batch_info
        if info is None:
            raise RuntimeError("TritonLoraBackend: call prepare_batch(batch_info) before the products")
        if not self._planned:
            self._plan_late(info)
        if self._graph_key is not None:
            self._split_keys.add(self._graph_key)  # its replays must refresh the plan
        num_tokens = x.shape[0]
        if not info.num_tokens <= num_tokens <= self._plan.max_tokens:
            raise ValueError(
                f"TritonLoraBackend: expected x with between {info.num_tokens} (the batch's tokens) and "
                f"{self._plan.max_tokens} rows, got {num_tokens}"
            )
        return info, max_tiles(num_tokens, info.num_slots, self._plan.block_m)

    def _plan_late(self, info: LoraBatchInfo) -> None:
        """Plan a decode-sized batch on the first separate product (eager only)."""
        if info.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("TritonLoraBackend: the separate products need a tile plan, which a graph "
                               "capture cannot make; bind the graph with init_metadata_for_capture first")
        block_m = self._graph_block_m.get(self._graph_key) or self.tuning.block_m or choose_block_m(info.num_tokens)
        self._bind(info, block_m)

    def _shrink_k_blocks(self, num_tokens: int, k: int) -> tuple[int, int]:
        """(BLOCK_K, SPLIT_K): decode-sized batches split K so that enough programs stream A."""
        small = num_tokens <= 256
        block_k = self.tuning.shrink_block_k or _pow2_between(k, 16, 256 if small else 128)
        split_k = self.tuning.shrink_split_k or (max(1, min(16, k // 512)) if small else 1)
        return block_k, split_k


def _check_fused_shapes(x, a_weights, b_weights, base_output, num_slices: int) -> None:
    num_tokens, k = x.shape
    num_slots, width, r_max = b_weights.shape
    if tuple(a_weights.shape) != (num_slots, num_slices * r_max, k) or tuple(base_output.shape) != (num_tokens, width):
        raise ValueError(
            f"apply_lora: expected x [T, K], a_weights [num_slots, {num_slices} * R_max, K], b_weights "
            f"[num_slots, N, R_max] and base_output [T, N], got {list(x.shape)}, {list(a_weights.shape)}, "
            f"{list(b_weights.shape)}, {list(base_output.shape)}"
        )
