"""ModelRunner: builds the model, pools, custom ops and attention backend(s) from EngineArgs
through the registry, and runs one forward pass (eagerly, or through the graph runner)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from backplane.contracts.attention import AttentionBackend, AttentionBackendContext
from backplane.attention.hybrid import HybridAttnBackend
from backplane.config import PoolConfig, resolve_graphs, resolve_pool
from backplane.contracts.batch import ForwardBatch, ForwardMode
from backplane.contracts.forward_context import ForwardContext
from backplane.executor.compiled import compiles_batch
from backplane.contracts.protocols import ForwardRouter, GraphContributor
from backplane.layers.attention import Attention
from backplane.layers.parallel import ParallelContext
from backplane.contracts.memory import ReqToTokenPool, TokenToKVPool
from backplane.contracts.model import ModelOutput
from backplane.models.base import ModelContext
from backplane.ops.dispatch import resolve_custom_ops
from backplane.plugin.manager import PluginSet
from backplane.plugin.runtime import build, build_first
from backplane.plugin.selection import AttentionRequirements, Selection, select_attention_backend
from backplane.settings import EngineArgs

if TYPE_CHECKING:
    from backplane.executor.graph_runner import GraphRunnerContext

logger = logging.getLogger(__name__)

CPU_KV_BUDGET_BYTES = 2 << 30
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(args: EngineArgs) -> torch.device:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available on this machine; use --device cpu or auto")
    if args.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(args.device)


def resolve_dtype(args: EngineArgs, device: torch.device) -> torch.dtype:
    if args.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[args.dtype]


def dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, value in _DTYPES.items() if value is dtype)


@dataclass
class ModelSource:
    """Where the model comes from: a preset (dummy weights) or a local Hugging Face directory."""

    hf_config: Any
    load_format: str
    path: Path | None


def resolve_model_source(args: EngineArgs) -> ModelSource:
    from backplane.models.loader import load_hf_config
    from backplane.models.presets import PRESETS, get_preset

    path = Path(args.model).expanduser()
    if path.is_dir():
        load_format = "safetensors" if args.load_format == "auto" else args.load_format
        return ModelSource(load_hf_config(path), load_format, path)
    if args.model in PRESETS:
        if args.load_format == "safetensors":
            raise ValueError(f"--model {args.model}: a preset has no weight files; use --load-format dummy or auto")
        return ModelSource(get_preset(args.model), "dummy", None)
    raise ValueError(
        f"--model {args.model!r}: expected a local Hugging Face model directory or a preset name; "
        f"presets: {', '.join(sorted(PRESETS))}"
    )


def context_length(args: EngineArgs, hf_config: Any) -> int:
    """--context-length, or the model's max_position_embeddings; never beyond it (positions past
    it have no rotary embedding)."""
    limit = int(hf_config.max_position_embeddings)
    if args.context_length is not None and args.context_length > limit:
        raise ValueError(f"--context-length {args.context_length}: expected at most the model's "
                         f"max_position_embeddings {limit}; positions past it have no rotary embedding")
    return args.context_length or limit


def available_memory(device: torch.device) -> int:
    """Bytes that can still be allocated on `device`: free device memory, or the host's available RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_pool_memory(device: torch.device, pools: list[tuple[str, int, int, str]]) -> None:
    """Refuse pools that cannot be allocated: (flag, value, bytes, what) each, against free memory."""
    free = available_memory(device)
    for flag, value, size, what in pools:
        if size > free:
            most = max(value * free // max(size, 1), 0)
            raise ValueError(f"{flag} {value}: {value} {what} need {_gib(size)} of {device.type} memory but "
                             f"{_gib(free)} is free; expected at most about {most}")


def _gib(size: int) -> str:
    return f"{size / 2**30:,.1f} GiB"


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
        self.model = self._build_model()
        self.layer_infos = [m.info for m in self.model.modules() if isinstance(m, Attention)]
        self.context_len = context_length(args, self.hf_config)
        self.req_to_token_pool, self.token_to_kv_pool = self._init_pools()
        self.attn_backend, self.attn_choices = self._init_attention()
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

        decode, verify = self.attn_choices["decode"], self.attn_choices["prefill"]
        parts = [GraphParticipant(decode.plugin, f"attention backend {decode.spec.name!r}",
                                  decode.spec.graph_modes, serves=("decode",)),
                 GraphParticipant(verify.plugin, f"attention backend {verify.spec.name!r}",
                                  verify.spec.graph_modes, serves=("target_verify",))]
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

    def init_cuda_graphs(self) -> None:
        """Capture graphs for the configured combination, or say why decode stays eager."""
        from backplane.executor.graph_runner import GraphRunner
        from backplane.executor.graph_sizes import capturable_modes

        self.graphs_initialized = True
        wanted = ["decode"] + (["target_verify"] if self.args.speculative_algorithm else [])
        modes: list[str] = []
        if self.args.disable_cuda_graph:
            pass
        elif self.device.type != "cuda":
            logger.info("CUDA graphs need a CUDA device; running eagerly on %s", self.device.type)
        else:
            modes, self.graph_mode_limits = capturable_modes(wanted, self.graph_participants())
            for limit in self.graph_mode_limits:
                logger.warning(limit.message())
        if self.args.enable_torch_compile and set(modes) != set(wanted):
            # A mode without graphs (none asked for, or a plugin declines them) still runs compiled:
            # --enable-torch-compile never silently falls back to the plain model.
            from backplane.executor.compiled import CompiledForward

            self.compiled_eager = CompiledForward(self.model, dynamic=None)
        if not modes:
            return
        self.graph_runner = GraphRunner(self.graph_context(), [ForwardMode(m) for m in modes])
        # NOTE: under tensor parallelism the graphs record the collectives (NCCL); every rank
        # captures the same keys in the same order, entered and left together.
        self.parallel.barrier()
        self.graph_runner.capture()
        self.parallel.barrier()

    # -- construction ---------------------------------------------------------------------------

    def _build_model(self) -> torch.nn.Module:
        from backplane.models.loader import check_checkpoint_shapes, get_model_spec, safetensors_files
        from backplane.models.loader import iterate_safetensors
        from backplane.models.presets import init_dummy_weights

        from backplane.models.config_check import check_model_memory

        spec = get_model_spec(self.registry.specs("model"), self.hf_config)
        # NOTE: before a byte is allocated: a huge vocabulary or context is one line, not an OOM.
        check_model_memory(self.hf_config, self.dtype.itemsize, available_memory(self.device), self.device.type,
                           self.parallel.tp_size)
        with torch.device(self.device):
            model = build(self.registry.provenance("model", spec.architecture), self.hf_config, self.model_ctx,
                          kind="model").to(self.dtype)
        if self.source.load_format == "dummy":
            init_dummy_weights(model, self.args.seed)
        else:
            if hasattr(model, "checkpoint_shapes"):  # a wrong shape is named before any tensor is read
                check_checkpoint_shapes(safetensors_files(self.source.path), dict(model.checkpoint_shapes()))
            model.load_weights(iterate_safetensors(self.source.path))
        return model.eval()

    def _init_pools(self) -> tuple[ReqToTokenPool, TokenToKVPool]:
        info = self.layer_infos[0]
        per_token = TokenToKVPool.bytes_per_token(len(self.layer_infos), info.num_kv_heads, info.head_dim, self.dtype)
        num_slots = self.args.max_total_tokens or self._profile_num_slots(per_token)
        if num_slots < 2:
            if self.args.max_total_tokens:
                raise ValueError(f"--max-total-tokens {num_slots}: expected at least 2 (slot 0 of the KV pool "
                                 "is the padding slot, so 1 leaves no room for any token)")
            raise ValueError(
                f"--mem-fraction-static {self.args.mem_fraction_static}: leaves room for {num_slots} KV "
                "tokens after the weights; raise it or pass --max-total-tokens"
            )
        req_rows = self.pool_config.req_rows
        max_ctx = min(self.context_len, num_slots) + self.pool_config.spec_room  # + a verify's draft tokens
        check_pool_memory(self.device, [
            ("--max-total-tokens", num_slots, num_slots * per_token, "KV tokens"),
            ("--max-running-requests", req_rows, (req_rows + 1) * max_ctx * 4, "request rows"),
        ])
        req_pool = ReqToTokenPool(req_rows + 1, max_ctx, self.device)  # + one row for graph padding
        kv_pool = TokenToKVPool(num_slots, len(self.layer_infos), info.num_kv_heads, info.head_dim,
                                self.dtype, self.device)
        logger.info("KV pool: %d tokens (%.1f MB), %d request rows", num_slots,
                    num_slots * per_token / 2**20, req_rows)
        return req_pool, kv_pool

    def _profile_num_slots(self, per_token: int) -> int:
        if self.device.type != "cuda":
            return max(2, min(CPU_KV_BUDGET_BYTES // per_token, 1 << 17))
        free, total = torch.cuda.mem_get_info(self.device)
        budget = total * self.args.mem_fraction_static - (total - free)
        # Rank 0 allocates slots for every rank: all pools get the size of the smallest.
        return self.parallel.min_over_ranks(int(budget // per_token))

    def attention_requirements(self, modes: tuple[str, ...]) -> AttentionRequirements:
        info = self.layer_infos[0]
        return AttentionRequirements(
            platform=self.device.type, dtype=dtype_name(self.dtype), head_dim=info.head_dim, modes=modes,
            sliding_window=any(i.sliding_window > 0 for i in self.layer_infos),
            logit_softcap=any(i.logit_softcap > 0 for i in self.layer_infos),
            custom_mask="target_verify" in modes,
        )

    def _init_attention(self) -> tuple[AttentionBackend, dict[str, Selection]]:
        spec_modes = ("target_verify", "draft_extend") if self.args.speculative_algorithm else ()
        prefill_name = self.args.prefill_attention_backend or self.args.attention_backend
        decode_name = self.args.decode_attention_backend or self.args.attention_backend
        prefill_flag = "--prefill-attention-backend" if self.args.prefill_attention_backend else "--attention-backend"
        decode_flag = "--decode-attention-backend" if self.args.decode_attention_backend else "--attention-backend"
        choices = {
            "prefill": select_attention_backend(self.registry, prefill_name,
                                                self.attention_requirements(("extend", *spec_modes)), prefill_flag),
            "decode": select_attention_backend(self.registry, decode_name,
                                               self.attention_requirements(("decode",)), decode_flag),
        }
        prefill, choices["prefill"] = build_first(choices["prefill"], self._backend_context, kind="attention")
        same = choices["decode"].spec is choices["prefill"].spec
        decode, choices["decode"] = ((prefill, choices["prefill"]) if same else
                                     build_first(choices["decode"], self._backend_context, kind="attention"))
        return (prefill if same else HybridAttnBackend(prefill, decode)), choices

    def _backend_context(self, choice: Selection) -> AttentionBackendContext:
        info = self.layer_infos[0]
        group = self.registry.options_group(choice.plugin)
        return AttentionBackendContext(
            num_heads=info.num_heads, num_kv_heads=info.num_kv_heads, head_dim=info.head_dim,
            num_layers=len(self.layer_infos), dtype=self.dtype, device=self.device,
            req_to_token_pool=self.req_to_token_pool, token_to_kv_pool=self.token_to_kv_pool,
            max_context_len=self.req_to_token_pool.max_context_len,
            options=self.args.options_for(group) if group else None, server_args=self.args,
        )

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
        """Which plugin served what (shown by `generate --json` and `bench`)."""
        return {
            "attention": {role: {"backend": c.spec.name, "plugin": c.plugin, "why": c.reason}
                          for role, c in self.attn_choices.items()},
            "custom_ops": dict(self.model_ctx.ops.chosen),
            "device": str(self.device), "dtype": dtype_name(self.dtype),
        }


def legacy_capture_hidden(batch: ForwardBatch) -> bool:
    """A batch whose deprecated `capture_hidden` was set (plugins of the first release)."""
    return bool(getattr(batch, "__dict__", {}).get("_legacy_capture_hidden", False))
