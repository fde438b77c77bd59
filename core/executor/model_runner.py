"""ModelRunner: builds the custom ops, the model, the pools and the attention backend(s) from
EngineArgs through the registry, in that order, and runs one forward pass (eagerly, or through the
graph runner).

What it runs on (device, dtype, model source, memory, pool sizes) is resolved in
backplane.executor.resources and the attention backends are chosen in backplane.executor.attention_setup;
the names of the first stay importable from here."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from backplane.config import PoolConfig, resolve_graphs, resolve_pool
from backplane.contracts.batch import ForwardBatch, ForwardMode
from backplane.contracts.forward_context import ForwardContext
from backplane.contracts.model import ModelOutput
from backplane.contracts.protocols import ForwardRouter, GraphContributor
from backplane.executor.attention_setup import AttentionSetup
from backplane.executor.compiled import compiles_batch
from backplane.executor.moe_setup import MoeSetup, moe_shape, note_dense_model, process_moe_layers, register_moe_layers
from backplane.executor.resources import (  # noqa: F401  (re-exported: their import path before the split)
    CPU_KV_BUDGET_BYTES, ModelSource, available_memory, build_pools, check_pool_memory, context_length, dtype_name,
    resolve_device, resolve_dtype, resolve_model_source,
)
from backplane.layers.attention import Attention
from backplane.layers.parallel import ParallelContext
from backplane.models.base import ModelContext
from backplane.ops.dispatch import resolve_custom_ops
from backplane.plugin.manager import PluginSet
from backplane.plugin.runtime import build
from backplane.plugin.selection import AttentionRequirements
from backplane.settings import EngineArgs

if TYPE_CHECKING:
    from backplane.executor.graph_runner import GraphRunnerContext

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model and everything it runs on for one tensor-parallel rank.

    parallel: this rank's tensor-parallel position (None: one rank). router: on rank 0 of a
    tensor-parallel engine, the TPDriver, through which every forward goes (it first sends the
    batch to the other ranks); None on one rank and on the workers. Components whose per-batch
    state the layers read (the LoraManager) join with `add_contributor`, before `init_cuda_graphs`.
    """

    def __init__(self, args: EngineArgs, plugin_set: PluginSet, parallel: ParallelContext | None = None,
                 router: ForwardRouter | None = None, pool: PoolConfig | None = None,
                 source: ModelSource | None = None):
        self.args = args
        self.plugin_set = plugin_set
        self.registry = plugin_set.registry
        self.parallel = parallel or ParallelContext()
        self.device = resolve_device(args)
        if self.device.type == "cuda" and self.parallel.tp_size > 1:  # one GPU per rank
            self.device = torch.device("cuda", self.parallel.tp_rank)
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(args, self.device)
        self.pool_config = pool or resolve_pool(args, self.device.type)  # resolved once (backplane.config)
        self.source = source or resolve_model_source(args)  # the engine's, read once
        self.hf_config = self.source.hf_config
        self.model_ctx = ModelContext(
            ops=resolve_custom_ops(list(self.registry.specs("custom_op").values()),
                                   self.device.type, args.custom_op_overrides, registry=self.registry, probe=True),
            dtype=self.dtype, device=self.device, parallel=self.parallel,
        )
        self.kv_scales = None  # the checkpoint's FP8 KV cache scales (set while its weights load)
        self.model = self._build_model()
        self.layer_infos = [m.info for m in self.model.modules() if isinstance(m, Attention)]
        self.context_len = context_length(args, self.hf_config)
        self.req_to_token_pool, self.token_to_kv_pool = build_pools(
            args, self.pool_config, self.layer_infos, context_len=self.context_len, device=self.device,
            dtype=self.dtype, parallel=self.parallel, kv_scales=self.kv_scales)
        self.attn_backend, self.attn_choices = self._attention_setup().build()
        self.model_ctx.attn_backend = self.attn_backend  # the model's backend, set once
        self.router = router
        self.contributors: list[GraphContributor] = []
        self.graphs_initialized = False
        self.graph_runner = None
        self.compiled_eager: Any = None  # torch.compile without graphs (--enable-torch-compile, no graphs)
        self.graph_mode_limits: list[Any] = []

    def add_contributor(self, contributor: GraphContributor) -> None:
        """Register a component whose per-batch state the layers read (the LoraManager): its
        `begin_forward` runs before every forward, and it takes part in graph capture and keys.
        Call before `init_cuda_graphs`, which captures a graph for every contributor's variants."""
        if not isinstance(contributor, GraphContributor):
            raise TypeError(f"model runner contributor: expected a GraphContributor (begin_forward, graph_participant, "
                            f"graph_variants, graph_key_extras, prepare_graph_batch), got {type(contributor).__name__}")
        if self.graphs_initialized:
            raise RuntimeError(f"model runner: add_contributor({type(contributor).__name__}) after init_cuda_graphs; "
                               "the graphs are already keyed, so register every contributor before")
        self.contributors.append(contributor)

    # -- CUDA graphs ----------------------------------------------------------------------------

    @property
    def seq_len_fill_value(self) -> int:
        return self.attn_choices["decode"].spec.seq_len_fill_value

    def graph_participants(self) -> list[Any]:
        from backplane.contracts.graph import GraphParticipant

        decode, prefill = self.attn_choices["decode"], self.attn_choices["prefill"]
        parts = [GraphParticipant(decode.plugin, f"attention backend {decode.spec.name!r}",
                                  decode.spec.graph_modes, serves=("decode",),
                                  piecewise_modes=tuple(decode.spec.piecewise_graph_modes)),
                 GraphParticipant(prefill.plugin, f"attention backend {prefill.spec.name!r}",
                                  prefill.spec.graph_modes, serves=("target_verify", "extend"),
                                  piecewise_modes=tuple(prefill.spec.piecewise_graph_modes))]
        return parts + [c.graph_participant() for c in self.contributors]

    def graph_context(self) -> GraphRunnerContext:
        """What a GraphRunner of this runner reads."""
        from backplane.executor.graph_runner import GraphRunnerContext

        return GraphRunnerContext(
            model=self.model, model_ctx=self.model_ctx, attn_backend=self.attn_backend,
            attention=self.attn_choices["decode"], req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=self.token_to_kv_pool, device=self.device, config=resolve_graphs(self.args),
            contributors=tuple(self.contributors),
        )

    def wanted_graph_modes(self) -> list[str]:
        """The modes this configuration would capture: decode, extend (unless --disable-extend-graph),
        and verify with a speculative algorithm."""
        return (["decode"] + ([] if self.args.disable_extend_graph else ["extend"])
                + (["target_verify"] if self.args.speculative_algorithm else []))

    def init_cuda_graphs(self) -> None:
        """Capture graphs for the configured combination, or say why decode stays eager."""
        from backplane.executor.graph_runner import GraphRunner
        from backplane.executor.graph_sizes import capture_kinds

        self.graphs_initialized = True
        modes: dict[str, str] = {}
        if self.args.disable_cuda_graph:
            pass
        elif self.device.type != "cuda":
            logger.info("CUDA graphs need a CUDA device; running eagerly on %s", self.device.type)
        else:
            modes, self.graph_mode_limits = capture_kinds(self.wanted_graph_modes(), self.graph_participants())
            for limit in self.graph_mode_limits:
                logger.warning(limit.message())
        wanted = self.wanted_graph_modes()
        if self.args.enable_torch_compile and set(modes) != set(wanted):
            # A mode without graphs (none asked for, or a plugin declines them) still runs compiled:
            # --enable-torch-compile never silently falls back to the plain model.
            from backplane.executor.compiled import CompiledForward

            self.compiled_eager = CompiledForward(self.model, dynamic=None)
        if not modes:
            return
        self.graph_runner = GraphRunner(self.graph_context(), {ForwardMode(m): kind for m, kind in modes.items()})
        # NOTE: under tensor parallelism the graphs record the collectives (NCCL); every rank
        # captures the same keys in the same order, entered and left together.
        self.parallel.barrier()
        self.graph_runner.capture()
        self.parallel.barrier()

    # -- construction ---------------------------------------------------------------------------

    def _build_model(self) -> torch.nn.Module:
        from backplane.models.loader import check_checkpoint_shapes, get_model_spec, safetensors_files
        from backplane.models.loader import iterate_safetensors, process_weights_after_loading, quantize_linears
        from backplane.models.presets import init_dummy_weights

        from backplane.models.config_check import check_model_memory

        spec = get_model_spec(self.registry.specs("model"), self.hf_config)
        quant = self._quant_config()  # refused in one line before anything is allocated
        self._moe_setup()  # before the model: its MoE layers read model_ctx.moe_backend
        # NOTE: before a byte is allocated: a huge vocabulary or context is one line, not an OOM.
        check_model_memory(self.hf_config, self.dtype.itemsize, available_memory(self.device), self.device.type,
                           self.parallel.tp_size)
        with torch.device(self.device):
            model = build(self.registry.provenance("model", spec.architecture), self.hf_config, self.model_ctx,
                          kind="model").to(self.dtype)
            if quant is not None:  # after the cast: the FP8 weights and fp32 scales keep their dtypes
                kept = quantize_linears(model, quant, getattr(model, "stacked_params", None))
                logger.info("quantization %s: %s", self.quant_choice.spec.name,
                            f"kept in {dtype_name(self.dtype)}: {', '.join(kept)}" if kept else "every linear layer")
            if self.moe_choice is not None:
                register_moe_layers(model, self.model_ctx.moe_backend, quant)  # quantized experts too
        if self.source.load_format == "dummy":
            init_dummy_weights(model, self.args.seed)
        else:
            if hasattr(model, "checkpoint_shapes"):  # a wrong shape is named before any tensor is read
                check_checkpoint_shapes(safetensors_files(self.source.path), dict(model.checkpoint_shapes()))
            from backplane.executor.kv_scales import KVCacheScales

            self.kv_scales = KVCacheScales()
            tensors = iterate_safetensors(self.source.path)  # the KV cache scales go to the pool, not the model
            model.load_weights((name, t) for name, t in tensors if not self.kv_scales.offer(name, t))
        process_weights_after_loading(model)
        process_moe_layers(model)
        return model.eval()

    def _moe_setup(self) -> None:
        """For a MoE model, select and build the MoE backend (--moe-backend) and make it the model's;
        sets moe_choice (None for a dense model, which builds none)."""
        shape = moe_shape(self.hf_config)
        self.moe_choice = None
        if shape is None:
            note_dense_model(self.registry, self.args.moe_backend)
            return
        quant = self.quant_choice.spec.name if self.quant_choice is not None else None
        setup = MoeSetup(self.args, self.registry, shape, self.device, self.dtype, self.pool_config, quant)
        self.model_ctx.moe_backend, self.moe_choice = setup.build()

    def _quant_config(self) -> Any:
        """The QuantConfig of --quantization for this checkpoint (None: unquantized); sets quant_choice."""
        from backplane.contracts.quant import QuantConfig, QuantContext
        from backplane.models.loader import checkpoint_quant_format, quantization_config_of
        from backplane.plugin.selection import QuantRequirements, select_quant_method

        args = self.args
        req = QuantRequirements(
            platform=self.device.type, dtype=dtype_name(self.dtype),
            checkpoint_format=checkpoint_quant_format(self.hf_config), lora=bool(args.lora_paths),
            tensor_parallel=self.parallel.tp_size > 1, compile=args.enable_torch_compile,
            graphs=self.device.type == "cuda" and not args.disable_cuda_graph)
        self.quant_choice = select_quant_method(self.registry, args.quantization, req)
        if self.quant_choice is None:
            return None
        checkpoint = quantization_config_of(self.hf_config) if req.checkpoint_format is not None else None
        group = self.registry.options_group(self.quant_choice.plugin)
        ctx = QuantContext(checkpoint, self.dtype, self.device, options=args.options_for(group) if group else None)
        quant = build(self.quant_choice, ctx, kind="quant")
        if not isinstance(quant, QuantConfig):
            raise TypeError(f"quantization method {self.quant_choice.spec.name!r} (plugin {self.quant_choice.plugin!r}): "
                            f"factory returned {type(quant).__name__}, expected a QuantConfig")
        return quant

    def attention_requirements(self, modes: tuple[str, ...]) -> AttentionRequirements:
        """What an attention backend serving `modes` must support for this model, device and dtype."""
        return self._attention_setup().requirements(modes)

    def _attention_setup(self) -> AttentionSetup:
        return AttentionSetup(self.args, self.registry, self.layer_infos, self.device, self.dtype,
                              self.req_to_token_pool, self.token_to_kv_pool)

    # -- running --------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, *, capture_hidden: bool = False, use_graph: bool = True) -> ModelOutput:
        """One forward pass: through a captured graph when `use_graph` and one can replay `batch`,
        else eagerly (compiled under --enable-torch-compile). Under tensor parallelism the router
        sends the batch to the other ranks first. capture_hidden: the output carries the final
        hidden states too (EAGLE drafts from them)."""
        return self._dispatch(batch, capture_hidden, use_graph)

    @torch.inference_mode()
    def forward_eager(self, batch: ForwardBatch, *, capture_hidden: bool = False) -> ModelOutput:
        """`forward(batch, use_graph=False)`: eagerly (or compiled), on every rank."""
        return self._dispatch(batch, capture_hidden, use_graph=False)

    def _dispatch(self, batch: ForwardBatch, capture_hidden: bool, use_graph: bool) -> ModelOutput:
        capture_hidden = capture_hidden or legacy_capture_hidden(batch)
        if self.router is not None:
            return self.router.run(batch, lambda b: self._forward_local(b, capture_hidden, use_graph),
                                   use_graph=use_graph)
        return self._forward_local(batch, capture_hidden, use_graph)

    def _forward_local(self, batch: ForwardBatch, capture_hidden: bool, use_graph: bool) -> ModelOutput:
        if use_graph and self.graph_runner is not None:
            key = self.graph_runner.key_for(batch, capture_hidden)
            if key is not None:
                return self.graph_runner.replay(batch, key)
        return self._run_eager(batch, capture_hidden)

    def _run_eager(self, batch: ForwardBatch, capture_hidden: bool) -> ModelOutput:
        """Plan the attention metadata, collect every contributor's bindings (outside any compiled
        region), then run the model under one ForwardContext."""
        self.attn_backend.init_forward_metadata(batch)
        bindings = {}
        for contributor in self.contributors:
            bindings.update(contributor.begin_forward(batch))
        model, ops = self.model, self.model_ctx.default_ops
        if self.compiled_eager is not None and compiles_batch(self.args, batch):
            model, ops = self.compiled_eager, self.compiled_eager.compile_ops(ops)
        context = ForwardContext(batch=batch, attn_backend=self.attn_backend, ops=ops, bindings=bindings,
                                 capture_hidden=capture_hidden)
        with self.model_ctx.bind(context):
            return model(batch)

    def backends_summary(self) -> dict[str, Any]:
        """Which plugin served what (shown by `generate --json` and `bench`); "moe" only for a MoE model."""
        summary = {
            "attention": {role: {"backend": c.spec.name, "plugin": c.plugin, "why": c.reason}
                          for role, c in self.attn_choices.items()},
            "custom_ops": dict(self.model_ctx.ops.chosen),
            "device": str(self.device), "dtype": dtype_name(self.dtype),
        }
        if self.moe_choice is not None:  # a MoE model
            summary["moe"] = {"backend": self.moe_choice.spec.name, "plugin": self.moe_choice.plugin,
                              "why": self.moe_choice.reason}
        return summary


def legacy_capture_hidden(batch: ForwardBatch) -> bool:
    """A batch whose deprecated `capture_hidden` was set (plugins of the first release)."""
    return bool(getattr(batch, "__dict__", {}).get("_legacy_capture_hidden", False))
