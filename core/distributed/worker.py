"""The entry point of a spawned tensor-parallel worker (ranks 1..N-1) and its serving loop."""

from __future__ import annotations

import importlib
import os
import signal
import threading
import time
import traceback
from typing import Any

from backplane.distributed.launcher import WorkerConfig, apply_env, init_groups
from backplane.settings import ENV_TEST_FAIL_RANK

PARENT_CHECK_S = 1.0


def injected_failure(rank: int, stage: str) -> None:
    """Raise when BACKPLANE_TEST_FAIL_RANK names this rank and stage ("RANK" means stage start)."""
    raw = os.environ.get(ENV_TEST_FAIL_RANK, "").strip()
    if not raw:
        return
    wanted_rank, _, wanted_stage = raw.partition(":")
    if int(wanted_rank) == rank and (wanted_stage or "start") == stage:
        raise RuntimeError(f"injected failure at {stage} ({ENV_TEST_FAIL_RANK}={raw})")


def resolve_plugins(extra: list[Any]) -> list[Any]:
    """Plugin objects from the driver; module names (str) are imported here."""
    return [importlib.import_module(item) if isinstance(item, str) else item for item in extra]


def _exit_with_parent(parent_pid: int) -> None:
    """A daemon thread: end this process when rank 0's process is gone."""
    while True:
        time.sleep(PARENT_CHECK_S)
        if os.getppid() != parent_pid:
            os._exit(3)


def build_rank(config: WorkerConfig, ready: Any = None):
    """This rank's runtime (plugins, weights shard, pools, LoRA, graphs; `build_runtime`'s order,
    `ready(lora)` before the graphs) and its LoRA mirror; returns (runner, mirror)."""
    import torch

    from backplane.distributed.lora_sync import LoraMirror
    from backplane.plugin.manager import load_plugins
    from backplane.runtime import build_runtime

    if config.num_threads > 0:
        torch.set_num_threads(config.num_threads)
    if config.backend == "nccl":
        torch.cuda.set_device(config.rank)  # before anything (a plugin) can create a CUDA context
    parallel = init_groups(config.rank, config.world_size, config.port, config.backend)
    injected_failure(config.rank, "start")
    args = config.args
    plugin_set = load_plugins(strict=args.strict_plugins, extra=resolve_plugins(config.extra_plugins))
    plugin_set.configure(args)
    runtime = build_runtime(args, plugin_set, parallel, speculative=False, ready=ready)
    return runtime.runner, LoraMirror(runtime.lora)


def serve(config: WorkerConfig, runner: Any, mirror: Any) -> None:
    """Run every batch rank 0 broadcasts until it sends None (stop)."""
    import torch

    from backplane.distributed.batch_sync import unpack_batch
    from backplane.distributed.broadcast import broadcast_object

    group = runner.parallel.cpu_group
    with torch.inference_mode():
        while True:
            msg = broadcast_object(None, config.rank, group)
            if msg is None:
                return
            injected_failure(config.rank, "forward")
            batch = unpack_batch(msg, runner.req_to_token_pool, runner.token_to_kv_pool, runner.device,
                                 runner.parallel.group)
            mirror.apply(msg, batch)
            runner.forward(batch, use_graph=msg.use_graph)


def worker_main(config: WorkerConfig, reports: Any) -> None:
    """Spawned process body: build the rank, report ready, capture graphs, serve, then exit.

    Any exception is reported as ("error", rank, "Type: message") and the process exits with 1.
    """
    apply_env(config.env)
    # NOTE: Ctrl-C reaches the whole process group; rank 0 handles it and stops this worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    code = 0
    try:
        runner, mirror = build_rank(config, ready=lambda lora: reports.put(("ready", config.rank, None)))
        serve(config, runner, mirror)
    except BaseException as exc:  # noqa: BLE001 - everything goes back to rank 0
        traceback.print_exc()
        reports.put(("error", config.rank, f"{type(exc).__name__}: {exc}"))
        code = 1
    finally:
        reports.close()
        reports.join_thread()  # the report reaches rank 0 before this process ends
    if code == 0:
        _shutdown_groups()  # NOTE: not after a failure, where a peer may be gone mid-collective
    os._exit(code)


def _shutdown_groups() -> None:
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the process is ending anyway
        pass
