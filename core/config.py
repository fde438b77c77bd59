"""Per-component settings, derived from EngineArgs once.

`EngineArgs` is what the user types (37 fields); each component takes only the few values it
needs, already resolved, as a small frozen dataclass. The derived values are computed here and
nowhere else, and logged once (`RuntimeConfig.describe`):

- the running-request limit: --max-running-requests, else DEFAULT_RUNNING_REQUESTS[device type];
  it is also the number of request rows of the request pool (which has one more, for graph padding);
- the room a request row keeps past the context for speculative draft tokens: a verify step writes
  --speculative-num-draft-tokens positions after the last cached one (0 without speculation);
- overlap scheduling: on unless --disable-overlap-schedule or a speculative algorithm (its step
  reads the accepted tokens before the next one is built);
- the prefix cache: on unless --disable-radix-cache or the speculative worker refuses it
  (`resolve_prefix_cache`, once the worker exists);
- tensor parallelism: the world size and the process-group backend.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_RUNNING_REQUESTS = {"cuda": 256, "cpu": 64}
DEFAULT_MAX_EXTEND_TOKENS = 512  # extend graphs: the largest token bucket unless --cuda-graph-max-tokens


@dataclass(frozen=True)
class PoolConfig:
    """The request pool: `req_rows` rows for requests, each `spec_room` positions past the context."""

    req_rows: int
    spec_room: int


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler needs: at most `max_running` requests hold a request row at once, a prefill
    batch computes at most `chunk_size` new tokens, `seed` seeds the shared sampling generator, and
    `overlap` launches the next step before the previous one's tokens are read."""

    max_running: int
    chunk_size: int
    seed: int = 0
    overlap: bool = False

    def __post_init__(self) -> None:
        for name in ("max_running", "chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"SchedulerConfig.{name}: expected an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class PrefixCacheConfig:
    """Whether the radix prefix cache is on, and if not why (a flag or the speculative algorithm)."""

    enabled: bool
    disabled_reason: str | None = None


@dataclass(frozen=True)
class TensorParallelConfig:
    """`world_size` ranks (1: no tensor parallelism) over a "nccl" or "gloo" process group."""

    world_size: int
    backend: str


@dataclass(frozen=True)
class RuntimeConfig:
    """Every derived value of one engine, resolved once by `resolve_runtime`."""

    device: str
    pool: PoolConfig
    scheduler: SchedulerConfig
    tensor_parallel: TensorParallelConfig

    def describe(self) -> str:
        """One line for the log: the derived values and where they came from."""
        s = self.scheduler
        return (f"runtime: device {self.device}, {s.max_running} running requests (request rows), "
                f"{self.pool.spec_room} draft positions per row, prefill chunk {s.chunk_size} tokens, "
                f"overlap {'on' if s.overlap else 'off'}, tp {self.tensor_parallel.world_size} "
                f"({self.tensor_parallel.backend})")


def resolve_runtime(args: Any, device: Any) -> RuntimeConfig:
    """The derived values of `args` (EngineArgs) on `device` (a torch.device or its type, "cpu"/"cuda")."""
    device_type = getattr(device, "type", device)
    if device_type not in DEFAULT_RUNNING_REQUESTS:
        raise ValueError(f"resolve_runtime: device {device_type!r}: expected one of "
                         f"{', '.join(DEFAULT_RUNNING_REQUESTS)}")
    max_running = args.max_running_requests or DEFAULT_RUNNING_REQUESTS[device_type]
    speculative = bool(args.speculative_algorithm)
    config = RuntimeConfig(
        device=device_type,
        pool=resolve_pool(args, device_type),
        scheduler=SchedulerConfig(max_running=max_running, chunk_size=args.chunked_prefill_size, seed=args.seed,
                                  overlap=not args.disable_overlap_schedule and not speculative),
        tensor_parallel=TensorParallelConfig(args.tp_size, "nccl" if device_type == "cuda" else "gloo"),
    )
    logger.info("%s", config.describe())
    return config


@dataclass(frozen=True)
class GraphConfig:
    """What the graph runner reads (the --cuda-graph-* and torch.compile flags, and the verify
    graphs' tokens per request); named as the flags, so graph_sizes' functions take it or EngineArgs."""

    cuda_graph_bs: tuple[int, ...] | None
    cuda_graph_max_bs: int
    disable_cuda_graph_padding: bool
    enable_torch_compile: bool
    torch_compile_max_bs: int
    speculative_num_draft_tokens: int
    mem_fraction_static: float  # named in a capture failure's remedies
    disable_extend_graph: bool = False
    cuda_graph_max_tokens: int = 512  # the largest extend token bucket (resolved: at most the chunk size)
    cuda_graph_max_extend_bs: int = 8


def resolve_graphs(args: Any) -> GraphConfig:
    """The graph runner's settings of `args` (EngineArgs)."""
    return GraphConfig(
        cuda_graph_bs=tuple(args.cuda_graph_bs) if args.cuda_graph_bs else None,
        cuda_graph_max_bs=args.cuda_graph_max_bs, disable_cuda_graph_padding=args.disable_cuda_graph_padding,
        enable_torch_compile=args.enable_torch_compile, torch_compile_max_bs=args.torch_compile_max_bs,
        speculative_num_draft_tokens=args.speculative_num_draft_tokens,
        mem_fraction_static=args.mem_fraction_static,
        disable_extend_graph=args.disable_extend_graph,
        cuda_graph_max_tokens=min(args.cuda_graph_max_tokens or DEFAULT_MAX_EXTEND_TOKENS, args.chunked_prefill_size),
        cuda_graph_max_extend_bs=args.cuda_graph_max_extend_bs,
    )


def resolve_pool(args: Any, device_type: str) -> PoolConfig:
    """The request pool's rows (the running-request limit) and the positions past the context a
    speculative verify writes (its draft tokens; none without speculation)."""
    rows = args.max_running_requests or DEFAULT_RUNNING_REQUESTS[device_type]
    return PoolConfig(req_rows=rows, spec_room=args.speculative_num_draft_tokens if args.speculative_algorithm else 0)


def resolve_prefix_cache(args: Any, spec_refusal: str | None = None) -> PrefixCacheConfig:
    """On unless --disable-radix-cache, or the speculative worker cannot start from a cached prefix
    (`spec_refusal`, then off with a warning saying why)."""
    if args.disable_radix_cache:
        return PrefixCacheConfig(False, "--disable-radix-cache")
    if spec_refusal:
        logger.warning("prefix cache off: %s (pass --disable-radix-cache to say so)", spec_refusal)
        return PrefixCacheConfig(False, spec_refusal)
    return PrefixCacheConfig(True)


def largest_weight_matrix(hf_config: Any) -> int:
    """Elements of the model's largest weight matrix (embedding or MLP projection), from its config."""
    hidden = int(hf_config.hidden_size)
    return max(int(hf_config.vocab_size) * hidden, hidden * int(getattr(hf_config, "intermediate_size", hidden)))


def apply_cpu_threads(args: Any, hf_config: Any) -> str:
    """Set torch's CPU threads for `args` and the model of `hf_config` (resolve_cpu_threads's rule);
    returns the line that says how many and why. Process-wide: call it where a process starts serving."""
    import torch

    from backplane.settings import resolve_cpu_threads

    threads, source = resolve_cpu_threads(args, largest_weight_matrix(hf_config))
    torch.set_num_threads(threads)
    hint = "" if source == "--cpu-threads" else "; --cpu-threads N overrides"
    return f"CPU threads: {threads} ({source}{hint})"
