"""LoraManager: multi-LoRA serving for one model runner.

It loads and validates the `--lora-paths` adapters (on the host), selects and builds the LoRA
backend, wraps the model's projections, and then takes part in two loops:

- scheduling (a Scheduler participant): `can_admit` keeps the distinct adapters of the running
  requests within `--max-loras-per-batch`; `prepare_batch` makes the batch's adapters resident
  (loading into free slots, evicting the least recently used adapter no running request uses)
  and describes the batch, one segment per request, in `batch.lora_info`.
- CUDA graphs (a graph contributor of the model runner): graphs are keyed by LoRA on/off; a
  base-only batch has `lora_info` None and runs without LoRA kernels. Captured graphs read
  `graph_info`, whose buffers are rewritten in place at replay (padded requests use slot 0).

Eager batches use `info`; replay copies their segments into `graph_info`, so an eager run of the
same batch after a replay (as tests do) still sees its own segments.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from backplane.executor.graph_sizes import GraphParticipant
from backplane.lora.adapter import AdapterError, LoraAdapter, ProjectionShape, load_adapter, read_adapter_config
from backplane.lora.base import LoraBackendContext
from backplane.lora.batch_info import LoraBatchInfo
from backplane.lora.layers import LoraLinear, LoraRuntime, full_projection_shape, wrap_model
from backplane.lora.pool import SlotPool
from backplane.plugin.selection import LoraRequirements, select_lora_backend

logger = logging.getLogger(__name__)

GRAPH_MODES = ("decode", "target_verify")


class LoraManager:
    """Adapters, their device slots and the LoRA backend of one model runner."""

    def __init__(self, runner: Any) -> None:
        from backplane.executor.model_runner import dtype_name

        args = runner.args
        self.paths = args.lora_path_map
        configs = {name: read_adapter_config(name, path) for name, path in self.paths.items()}
        self.max_rank = args.max_lora_rank or max(c.rank for c in configs.values())
        self.max_loras_per_batch = args.max_loras_per_batch
        self.num_slots = self.max_loras_per_batch + 1
        requirements = LoraRequirements(runner.device.type, dtype_name(runner.dtype), self.max_rank)
        self.selection = select_lora_backend(runner.registry, args.lora_backend, requirements)
        self.backend_ctx = self._backend_context(runner)
        self.backend = self.selection.spec.factory(self.backend_ctx)
        self.runtime = LoraRuntime(self.backend)
        self.layers: list[LoraLinear] = wrap_model(runner.model, self.runtime, self.num_slots, self.max_rank)
        self.adapters = self._load_adapters(runner)
        max_segments, max_tokens = self.backend_ctx.max_bs, self.backend_ctx.max_num_tokens
        self.info = LoraBatchInfo.allocate(max_segments, self.num_slots, runner.device, max_tokens)
        self.graph_info = LoraBatchInfo.allocate(max_segments, self.num_slots, runner.device, max_tokens)
        self.pool = SlotPool(self.max_loras_per_batch)
        self.ranks, self.scalings = [0] * self.num_slots, [0.0] * self.num_slots
        # The requests now running (set by the Engine): their adapters are not evicted.
        self.running: Callable[[], Iterable[Any]] = lambda: ()
        self._graph_state_ready = False
        runner.model.register_forward_pre_hook(self._bind_forward, with_kwargs=True)
        logger.info("LoRA: %d adapters, max rank %d, %d slots, backend %s (%s)", len(self.adapters),
                    self.max_rank, self.max_loras_per_batch, self.selection.spec.name, self.selection.reason)

    # -- construction ---------------------------------------------------------------------------

    def _backend_context(self, runner: Any) -> LoraBackendContext:
        args = runner.args
        max_bs = runner.req_to_token_pool.size  # every request row, the graph padding row included
        per_request = args.speculative_num_draft_tokens if args.speculative_algorithm else 1
        group = runner.registry.options_group(self.selection.plugin)
        return LoraBackendContext(
            device=runner.device, dtype=runner.dtype, max_loras_per_batch=self.max_loras_per_batch,
            max_lora_rank=self.max_rank, max_bs=max_bs,
            max_num_tokens=max(args.chunked_prefill_size, max_bs * per_request),
            options=args.options_for(group) if group else None,
        )

    def projection_shapes(self) -> dict[str, ProjectionShape]:
        """Each targetable projection's full (in, out) features (before any tensor-parallel split)."""
        shapes = {}
        for layer in self.layers:
            for j, name in enumerate(layer.projections):
                shapes[name] = ProjectionShape(*full_projection_shape(layer, j))
        return shapes

    def _load_adapters(self, runner: Any) -> dict[str, LoraAdapter]:
        shapes = self.projection_shapes()
        num_layers = 1 + max(layer.layer_id for layer in self.layers)
        return {name: load_adapter(name, path, shapes, num_layers, self.max_rank, runner.dtype)
                for name, path in self.paths.items()}

    # -- the slot pool --------------------------------------------------------------------------

    def acquire(self, names: list[str | None]) -> list[int]:
        """The slot of each request's adapter (0: base only), loading the missing ones first."""
        needed = [n for n in dict.fromkeys(names) if n is not None]
        unknown = [n for n in needed if n not in self.adapters]
        if unknown:
            raise AdapterError(f"unknown LoRA adapter {unknown[0]!r}; loaded: {', '.join(sorted(self.adapters))}")
        pinned = {req.lora for req in self.running() if getattr(req, "lora", None) is not None}
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

    # -- scheduler participant ------------------------------------------------------------------

    def can_admit(self, req: Any, batch_mates: Iterable[Any]) -> bool:
        """False when running `req` next to `batch_mates` would need more adapters than slots."""
        if req.lora is None:
            return True
        names = {r.lora for r in batch_mates if r.lora is not None} | {req.lora}
        return len(names) <= self.max_loras_per_batch

    def prepare_batch(self, batch: Any, reqs: list[Any]) -> None:
        """Load the batch's adapters and set `batch.lora_info` (None when every request is base only).

        One segment per request, as long as its new tokens.
        """
        names = [req.lora for req in reqs]
        if all(name is None for name in names):
            batch.lora_info = None
            return
        slots = self.acquire(names)
        if batch.extend_seq_lens_cpu is not None:
            seg_lens = batch.extend_seq_lens_cpu.tolist()
        else:
            seg_lens = [batch.tokens_per_request] * len(reqs)
        batch.lora_info = self.info.update_(seg_lens, slots)

    def _bind_forward(self, module, args, kwargs) -> None:
        """Model forward pre-hook: point the LoRA layers at this batch, and plan an eager pass."""
        batch = args[0] if args else kwargs["batch"]
        info = batch.lora_info
        self.runtime.batch_info = info
        if info is not None and batch.graph_key is None:  # graph passes were planned by prepare_graph_batch
            self.backend.prepare_batch(info)

    # -- graph contributor ----------------------------------------------------------------------

    def graph_participant(self) -> GraphParticipant:
        spec = self.selection.spec
        modes = GRAPH_MODES if spec.supports_graph else ()
        return GraphParticipant(self.selection.plugin, f"LoRA backend {spec.name!r}", modes)

    def graph_variants(self) -> list[tuple]:
        return [(("lora", False),), (("lora", True),)]

    def graph_key_extras(self, batch: Any) -> tuple:
        return (("lora", batch.lora_info is not None),)

    def prepare_graph_batch(self, batch: Any, key: Any, real: Any = None) -> None:
        """Bind graph_info for capture (real None: every request base only) or copy `real`'s segments
        into it for replay (padded requests: slot 0, key.tokens_per_request tokens each)."""
        if not dict(key.extras).get("lora", False):
            batch.lora_info = None
            return
        tpr = key.tokens_per_request
        if real is None:
            self._ensure_graph_state()
            batch.lora_info = self.graph_info.update_([tpr] * key.batch_size, [0] * key.batch_size)
            self.backend.init_metadata_for_capture(key, self.graph_info)
            return
        source = real.lora_info
        seg_lens = source.seg_lens_cpu[: source.bs].tolist()
        slots = source.weight_indices_cpu[: source.bs].tolist()
        pad = key.batch_size - real.batch_size
        batch.lora_info = self.graph_info.update_(seg_lens + [tpr] * pad, slots + [0] * pad)
        self.backend.init_metadata_for_replay(key, self.graph_info)

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
        }


def attach_lora(runner: Any) -> LoraManager | None:
    """Build the LoraManager when `--lora-paths` names adapters, and register it with the runner's
    graph contributors (call before `runner.init_cuda_graphs()`); None without adapters."""
    if not runner.args.lora_path_map:
        _check_unused_backend_name(runner)
        return None
    manager = LoraManager(runner)
    runner.graph_contributors.append(manager)
    return manager


def _check_unused_backend_name(runner: Any) -> None:
    """Without adapters no LoRA backend is built, but a misspelt --lora-backend is still an error."""
    from backplane.plugin.selection import require_known

    require_known(runner.registry, "lora", runner.args.lora_backend, "--lora-backend")
