"""LoraManager: multi-LoRA serving for one model runner.

It loads and validates the `--lora-paths` adapters (on the host), selects and builds the LoRA
backend, wraps the model's projections, and then takes part in two loops:

- scheduling (a `SchedulerParticipant`): `can_admit` keeps the distinct adapters of the running
  requests within `--max-loras-per-batch`; `prepare_batch` makes the batch's adapters resident
  (loading into free slots, evicting the least recently used adapter no running request uses,
  the running requests read from the source given to `bind_running`) and describes the batch,
  one segment per request, in `batch.plugin_inputs["lora"]` (a LoraSegments of host ints).
- forwards and CUDA graphs (a `GraphContributor` of the model runner, `attach_lora`): the runner
  calls `begin_forward(batch)` before an eager forward and binds what it returns, {"lora":
  LoraBatchInfo or None}, in the forward's ForwardContext, where the LoRA layers read it. Graphs
  are keyed by LoRA on/off; a base-only batch has no "lora" input and runs without LoRA kernels.
  Captured graphs read `graph_info`, whose buffers are rewritten in place at replay (padded
  requests use slot 0). Decode and verify graphs hold key.tokens_per_request tokens per request;
  extend graphs (ragged keys) hold a token bucket shared by requests of any lengths, whose padded
  requests' segments are the padded view's extend lengths, so the segments cover exactly the
  bucket's tokens in the graph's layout. Which of these modes are captured is the backend's
  `LoraBackendSpec.graph_modes` (with supports_graph).

Eager batches use `info`; replay copies their segments into `graph_info`, so an eager run of the
same batch after a replay (as tests do) still sees its own segments.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from backplane.contracts.graph import GraphParticipant
from backplane.contracts.protocols import RunningRequests
from backplane.lora.adapter import AdapterError, LoraAdapter, ProjectionShape, load_adapter, read_adapter_config
from backplane.contracts.lora import LoraBackendContext
from backplane.contracts.lora_batch import LoraBatchInfo, LoraSegments
from backplane.lora.layers import LoraLinear, LoraRuntime, full_projection_shape, wrap_model
from backplane.lora.pool import SlotPool
from backplane.plugin.runtime import build_first
from backplane.plugin.selection import LoraRequirements, select_lora_backend

if TYPE_CHECKING:
    from backplane.executor.model_runner import ModelRunner
    from backplane.plugin.registry import Registry
    from backplane.settings import EngineArgs

logger = logging.getLogger(__name__)

GRAPH_MODES = ("decode", "target_verify", "extend")  # the modes prepare_graph_batch binds
LORA = "lora"  # the name of its plugin input and of its forward binding


@dataclass(frozen=True)
class LoraContext:
    """What a LoraManager reads from its model runner (`lora_context(runner)`).

    model: wrapped in place (its projections become LoraLinear); registry: where the LoRA backend
    is selected; args: the LoRA settings (--lora-paths, --max-lora-rank, --max-loras-per-batch,
    --lora-backend and its option group) and the batch shape (--chunked-prefill-size, the
    speculative draft-token count); max_bs: request rows, the graph padding row included.
    """

    model: torch.nn.Module
    model_ctx: Any  # the model's ModelContext: its forward slot carries the LoRA binding to the layers
    registry: Registry
    args: EngineArgs
    device: torch.device
    dtype: torch.dtype
    max_bs: int


def lora_context(runner: ModelRunner) -> LoraContext:
    return LoraContext(model=runner.model, model_ctx=runner.model_ctx, registry=runner.registry, args=runner.args, device=runner.device,
                       dtype=runner.dtype, max_bs=runner.req_to_token_pool.size)


class LoraManager:
    """Adapters, their device slots and the LoRA backend of one model runner."""

    def __init__(self, ctx: LoraContext) -> None:
        from backplane.executor.model_runner import dtype_name

        args = ctx.args
        self.paths = args.lora_path_map
        configs = {name: read_adapter_config(name, path) for name, path in self.paths.items()}
        self.max_rank = args.max_lora_rank or max(c.rank for c in configs.values())
        self.max_loras_per_batch = args.max_loras_per_batch
        self.num_slots = self.max_loras_per_batch + 1
        requirements = LoraRequirements(ctx.device.type, dtype_name(ctx.dtype), self.max_rank)
        selection = select_lora_backend(ctx.registry, args.lora_backend, requirements)
        # failures are one line naming the plugin; under auto the next usable backend is built instead
        self.backend, self.selection = build_first(selection, lambda choice: self._backend_context(ctx, choice),
                                                   kind="lora")
        self.backend_ctx = self._backend_context(ctx, self.selection)
        self.runtime = LoraRuntime(self.backend, ctx.model_ctx.forward_slot)
        self.layers: list[LoraLinear] = wrap_model(ctx.model, self.runtime, self.num_slots, self.max_rank)
        self.decode_path = decode_path_of(self.backend, self.layers)
        if any(layer.fold_declined for layer in self.layers):
            logger.warning("LoRA: %s", self.decode_path)
        self.adapters = self._load_adapters(ctx.dtype)
        max_segments, max_tokens = self.backend_ctx.max_bs, self.backend_ctx.max_num_tokens
        self.info = LoraBatchInfo.allocate(max_segments, self.num_slots, ctx.device, max_tokens)
        self.graph_info = LoraBatchInfo.allocate(max_segments, self.num_slots, ctx.device, max_tokens)
        self.pool = SlotPool(self.max_loras_per_batch)
        self.ranks, self.scalings = [0] * self.num_slots, [0.0] * self.num_slots
        self.running_source: RunningRequests | None = None  # see bind_running
        self.mirrored: dict[int, str] = {}  # slot -> adapter loaded by _ensure_resident (tensor-parallel ranks)
        self._graph_state_ready = False
        logger.info("LoRA: %d adapters, max rank %d, %d slots, backend %s (%s)", len(self.adapters),
                    self.max_rank, self.max_loras_per_batch, self.selection.spec.name, self.selection.reason)

    # -- construction ---------------------------------------------------------------------------

    def _backend_context(self, ctx: LoraContext, choice: Any) -> LoraBackendContext:
        args = ctx.args
        per_request = args.speculative_num_draft_tokens if args.speculative_algorithm else 1
        group = ctx.registry.options_group(choice.plugin)
        return LoraBackendContext(
            device=ctx.device, dtype=ctx.dtype, max_loras_per_batch=self.max_loras_per_batch,
            max_lora_rank=self.max_rank, max_bs=ctx.max_bs,
            max_num_tokens=max(args.chunked_prefill_size, ctx.max_bs * per_request),
            options=args.options_for(group) if group else None,
        )

    def projection_shapes(self) -> dict[str, ProjectionShape]:
        """Each targetable projection's full (in, out) features (before any tensor-parallel split)."""
        shapes = {}
        for layer in self.layers:
            for j, name in enumerate(layer.projections):
                shapes[name] = ProjectionShape(*full_projection_shape(layer, j))
        return shapes

    def _load_adapters(self, dtype: torch.dtype) -> dict[str, LoraAdapter]:
        shapes = self.projection_shapes()
        num_layers = 1 + max(layer.layer_id for layer in self.layers)
        return {name: load_adapter(name, path, shapes, num_layers, self.max_rank, dtype)
                for name, path in self.paths.items()}

    # -- the slot pool --------------------------------------------------------------------------

    def acquire(self, names: list[str | None]) -> list[int]:
        """The slot of each request's adapter (0: base only), loading the missing ones first."""
        needed = [n for n in dict.fromkeys(names) if n is not None]
        unknown = [n for n in needed if n not in self.adapters]
        if unknown:
            raise AdapterError(f"unknown LoRA adapter {unknown[0]!r}; loaded: {', '.join(sorted(self.adapters))}")
        running = self.running_source.running if self.running_source is not None else ()
        pinned = {req.lora for req in running if getattr(req, "lora", None) is not None}
        loads = self.pool.assign(needed, pinned)
        for name, slot in loads:
            self._load_slot(name, slot)
        if loads:
            for info in (self.info, self.graph_info):
                info.set_slots_(self.ranks, self.scalings)
        return self.pool.slots_for(names)

    def _load_slot(self, name: str, slot: int) -> None:
        adapter = self.adapters[name]
        logger.debug("LoRA: loading adapter %r into slot %d", name, slot)
        for layer in self.layers:
            layer.load_slot(slot, [adapter.weights.get((layer.layer_id, p)) for p in layer.projections])
        self.ranks[slot], self.scalings[slot] = adapter.rank, adapter.scaling

    def mirror_slot(self, name: str, slot: int) -> None:
        """A tensor-parallel worker: load adapter `name` into `slot` as rank 0 did (this rank's
        shards of A/B), and refresh both batch infos' rank and scaling tables."""
        self._load_slot(name, slot)
        for info in (self.info, self.graph_info):
            info.set_slots_(self.ranks, self.scalings)

    def batch_info_for(self, seg_lens: list[int], slots: list[int]) -> LoraBatchInfo:
        """The eager batch info for segments decided elsewhere (a worker mirroring rank 0)."""
        return self.info.update_(seg_lens, slots)

    def resident_slots(self) -> dict[str, int]:
        """Adapter name -> the slot it is loaded in (what tensor-parallel workers mirror)."""
        return dict(self.pool.slot_of)

    # -- scheduler participant ------------------------------------------------------------------

    def bind_running(self, source: RunningRequests) -> None:
        """Read the running requests from `source` (the Scheduler, once it is built): their
        adapters are never evicted. Until then no adapter is pinned."""
        if not isinstance(source, RunningRequests):
            raise TypeError(f"LoraManager.bind_running: expected a RunningRequests (a `running` sequence of "
                            f"requests), got {type(source).__name__}")
        self.running_source = source

    def can_admit(self, req: Any, batch_mates: Iterable[Any]) -> bool:
        """False when running `req` next to `batch_mates` would need more adapters than slots."""
        if req.lora is None:
            return True
        names = {r.lora for r in batch_mates if r.lora is not None} | {req.lora}
        return len(names) <= self.max_loras_per_batch

    def prepare_batch(self, batch: Any, reqs: list[Any]) -> None:
        """Load the batch's adapters and describe it in `batch.plugin_inputs["lora"]` (a LoraSegments;
        absent when every request is base only): one segment per request, as long as its new tokens.
        The forward's LoRA binding is made from it by `begin_forward` / `prepare_graph_batch`."""
        names = [req.lora for req in reqs]
        if all(name is None for name in names):
            batch.plugin_inputs.pop(LORA, None)
            return
        slots = self.acquire(names)
        if batch.extend_seq_lens_cpu is not None:
            seg_lens = batch.extend_seq_lens_cpu.tolist()
        else:
            seg_lens = [batch.tokens_per_request] * len(reqs)
        batch.plugin_inputs[LORA] = LoraSegments(tuple(seg_lens), tuple(slots), tuple(self.pool.slot_of.items()))

    def _ensure_resident(self, segments: LoraSegments) -> None:
        """Load what `segments.slot_of` has resident and this manager does not (a tensor-parallel
        rank mirroring rank 0's slots; on rank 0 the table is its own, so nothing loads)."""
        for name, slot in segments.slot_of:
            if self.pool.slot_of.get(name) != slot and self.mirrored.get(slot) != name:
                self.mirror_slot(name, slot)
                self.mirrored[slot] = name

    # -- graph contributor ----------------------------------------------------------------------

    def begin_forward(self, batch: Any) -> dict[str, LoraBatchInfo | None]:
        """The eager forward's binding: {"lora": the batch's LoraBatchInfo, planned by the backend},
        or {"lora": None} for a base-only batch (the layers then run no LoRA kernel)."""
        segments = batch.plugin_inputs.get(LORA)
        if segments is None:
            return {LORA: None}
        self._ensure_resident(segments)
        info = self.info.update_(list(segments.seg_lens), list(segments.slots))
        self.backend.prepare_batch(info)
        return {LORA: info}

    def graph_participant(self) -> GraphParticipant:
        """The LoRA backend's graph modes: those its spec declares (graph_modes, with supports_graph)
        that this manager can bind."""
        spec = self.selection.spec
        modes = tuple(m for m in spec.graph_modes if m in GRAPH_MODES) if spec.supports_graph else ()
        return GraphParticipant(self.selection.plugin, f"LoRA backend {spec.name!r}", modes)

    def graph_variants(self) -> list[tuple]:
        return [((LORA, False),), ((LORA, True),)]

    def graph_key_extras(self, batch: Any) -> tuple:
        return ((LORA, batch.plugin_inputs.get(LORA) is not None),)

    def prepare_graph_batch(self, batch: Any, key: Any, real: Any = None) -> dict[str, LoraBatchInfo | None]:
        """The binding of a graph batch: graph_info bound for capture (real None: every request base
        only), or `real`'s segments copied into it for replay, padded requests on slot 0; {"lora":
        None} for a LoRA-off graph. `batch` is the padded view. Segments cover the key's tokens:
        key.tokens_per_request per request for a uniform key, the view's extend lengths for a
        ragged (extend) key, whose padded request takes the bucket's spare tokens."""
        if not dict(key.extras).get(LORA, False):
            return {LORA: None}
        seg_lens = graph_segment_lens(batch, key)
        if real is None:
            self._ensure_graph_state()
            info = self.graph_info.update_(seg_lens, [0] * key.batch_size)
            self.backend.init_metadata_for_capture(key, self.graph_info)
            return {LORA: info}
        segments = real.plugin_inputs[LORA]
        self._ensure_resident(segments)
        bs = real.batch_size
        if len(segments.seg_lens) != bs or sum(segments.seg_lens) != real.num_tokens:
            raise ValueError(f"LoRA graph replay: expected one segment per request ({bs}) covering the batch's "
                             f"{real.num_tokens} tokens, got seg_lens {list(segments.seg_lens)}")
        info = self.graph_info.update_(list(segments.seg_lens) + seg_lens[bs:],
                                       list(segments.slots) + [0] * (key.batch_size - bs))
        self.backend.init_metadata_for_replay(key, self.graph_info)
        return {LORA: info}

    def _ensure_graph_state(self) -> None:
        if not self._graph_state_ready:
            self.backend.init_graph_state(self.backend_ctx.max_bs, self.backend_ctx.max_num_tokens)
            self._graph_state_ready = True

    # -- reporting ------------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """What `Engine.backends` shows under "lora"."""
        return {
            "backend": self.selection.spec.name, "plugin": self.selection.plugin, "why": self.selection.reason,
            "adapters": {name: {"rank": a.rank, "scaling": a.scaling, "targets": list(a.config.target_modules)}
                         for name, a in self.adapters.items()},
            "max_lora_rank": self.max_rank, "max_loras_per_batch": self.max_loras_per_batch,
            "decode_path": self.decode_path,
        }


def decode_path_of(backend: Any, layers: list[LoraLinear]) -> str:
    """How decode-sized passes run the LoRA projections, in one line (the summary's "decode_path"):
    "folded" (the shrink inside the base GEMM, LoraBackend.folds_shrink), "unfolded" (the base
    layer, then the backend's LoRA kernels), or, where a folding backend is declined for some layers
    (a quantized base, a row-parallel layer on several ranks), how many and why."""
    if not backend.folds_shrink:
        return "unfolded (the backend does not fold the shrink into the base GEMM)"
    folded = sum(layer.w_ext is not None for layer in layers)
    if folded == len(layers):
        return "folded"
    declined = [layer.fold_declined for layer in layers if layer.fold_declined]
    parts = []
    if declined:
        parts.append(f"{len(declined)} declined: {declined[0]}")
    sharded = len(layers) - folded - len(declined)
    if sharded:
        parts.append(f"{sharded} row-parallel on several ranks (their shrink is all-reduced before the expand)")
    return f"folded path on {folded} of {len(layers)} projections, unfolded on the others: " + "; ".join(parts)


def graph_segment_lens(batch: Any, key: Any) -> list[int]:
    """Tokens per request of a graph batch of `key` (`batch`: the capture batch or the padded view):
    key.tokens_per_request each for a uniform key; for a ragged key the view's extend lengths
    (the capture batch's [T - (B - 1), 1, ..., 1]; at replay the real requests' new tokens, then
    the padded request's share of the bucket and zeros), which must fill the bucket exactly."""
    if not key.ragged:
        return [key.tokens_per_request] * key.batch_size
    if batch.extend_seq_lens_cpu is None:
        raise ValueError("LoRA graph batch: an extend graph batch needs extend_seq_lens_cpu, got None")
    lens = [int(n) for n in batch.extend_seq_lens_cpu.tolist()]
    if len(lens) != key.batch_size or sum(lens) != key.num_tokens:
        raise ValueError(f"LoRA graph batch: expected {key.batch_size} extend lengths summing to the bucket's "
                         f"{key.num_tokens} tokens, got {lens}")
    return lens


def attach_lora(runner: ModelRunner) -> LoraManager | None:
    """Build the LoraManager when `--lora-paths` names adapters and register it as a contributor of
    `runner` (`runner.add_contributor`; call before `runner.init_cuda_graphs()`); None without
    adapters."""
    if not runner.args.lora_path_map:
        _check_unused_backend_name(runner.registry, runner.args)
        return None
    manager = LoraManager(lora_context(runner))
    runner.add_contributor(manager)
    return manager


def _check_unused_backend_name(registry: Registry, args: EngineArgs) -> None:
    """Without adapters no LoRA backend is built, but a misspelt --lora-backend is still an error."""
    from backplane.plugin.selection import require_known

    require_known(registry, "lora", args.lora_backend, "--lora-backend")
