"""Rank 0's side of tensor parallelism: start the workers, send them every batch, stop them.

The Engine's process is rank 0: it owns the scheduler, and its ModelRunner is built with the
driver as its `ForwardRouter` (`ModelRunner(router=driver)`), so every forward goes through
`TPDriver.run`, which broadcasts the batch's host data before running the local forward. Any
failure stops the workers; a worker's own failure comes back as WorkerFailedError naming it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import weakref
from typing import Any, Callable, Iterator

import torch

from backplane.config import TensorParallelConfig
from backplane.distributed.batch_sync import pack_batch, send_input_ids
from backplane.distributed.broadcast import broadcast_object
from backplane.distributed.launcher import (WorkerConfig, WorkerHandles, apply_env, free_port,
                                            init_groups)
from backplane.distributed.worker import worker_main

logger = logging.getLogger(__name__)

FAILURE_GRACE_S = 2.0  # how long a rank-0 error waits for a worker's report of the real cause
WATCH_S = 0.5
# NOTE: torch.distributed's default group is per process, so one tensor-parallel engine at a time.
_ACTIVE: weakref.WeakSet = weakref.WeakSet()


class TPDriver:
    """The worker processes of one tensor-parallel engine, seen from rank 0 (a ForwardRouter)."""

    def __init__(self, args: Any, extra_plugins: list[Any], config: TensorParallelConfig | None = None):
        check_tp_settings(args)
        if len(_ACTIVE):
            raise RuntimeError("--tp-size: a tensor-parallel Engine is already running in this process; "
                               "call its shutdown() first")
        apply_env()
        self.args = args
        config = config or TensorParallelConfig(args.tp_size, "nccl" if _wants_cuda(args) else "gloo")
        self.world_size = config.world_size
        self.backend = config.backend
        port = free_port()
        configs = [WorkerConfig(rank, self.world_size, port, self.backend, args, _picklable(extra_plugins),
                                torch.get_num_threads()) for rank in range(1, self.world_size)]
        self.workers = WorkerHandles.spawn(worker_main, configs)
        self.failed: BaseException | None = None
        self.closed = False
        self.ready = False
        _ACTIVE.add(self)
        try:
            if self.backend == "nccl":
                torch.cuda.set_device(0)
            self.parallel = self.workers.run_polled(
                lambda: init_groups(0, self.world_size, port, self.backend), "joining the process groups")
        except BaseException:
            self.shutdown(failed=True)
            raise

    def wait_ready(self, lora: Any = None) -> None:
        """Wait for every worker's runner; from then on `run` serves forwards. (`lora`, rank 0's
        LoraManager, is not needed: a LoRA batch carries its slot table in `plugin_inputs`.)"""
        self.workers.wait_ready()
        self.ready = True
        if self.backend == "nccl":  # NCCL waits forever on a dead peer: abort the group instead
            threading.Thread(target=self._watch, name="backplane-tp-watch", daemon=True).start()

    def run(self, batch: Any, forward_local: Callable[[Any], Any], *, use_graph: bool = True) -> Any:
        """Broadcast `batch` to the workers, then run it here; returns rank 0's output. use_graph:
        whether every rank may replay a captured graph (False: all run it eagerly).

        The message is the batch's host data (no wait for the step in flight); placeholder input
        ids are followed by rank 0's resolved device ids over the tensor group (batch_sync.py).
        """
        if self.closed:
            raise RuntimeError(f"tensor-parallel engine is shut down{_after(self.failed)}")
        if not self.ready:
            raise RuntimeError("tensor-parallel driver: a forward before wait_ready(); the workers are not serving yet")
        msg = pack_batch(batch, use_graph=use_graph)
        try:
            broadcast_object(msg, 0, self.parallel.cpu_group)
            send_input_ids(msg, batch, self.parallel.group)
            return forward_local(batch)
        except BaseException as exc:
            raise_failure(self, exc)

    def fail(self, exc: BaseException) -> BaseException:
        """Stop everything after `exc`; returns the worker's failure that caused it, else `exc`."""
        failure = self.workers.failure(grace_s=FAILURE_GRACE_S) if not self.closed else None
        self.failed = failure or exc
        self.shutdown(failed=True)
        return self.failed

    def _watch(self) -> None:
        while not self.closed:
            failure = self.workers.failure(grace_s=WATCH_S)
            if failure is not None and not self.closed:
                logger.error("%s; aborting the process group", failure)
                self.failed = failure
                _abort_groups()
                return

    def shutdown(self, failed: bool = False) -> None:
        """Stop the workers (tell them, join, terminate stragglers) and leave the process groups."""
        if self.closed:
            return
        self.closed = True
        _ACTIVE.discard(self)
        parallel = getattr(self, "parallel", None)
        if parallel is not None and not failed:
            with contextlib.suppress(Exception):
                broadcast_object(None, 0, parallel.cpu_group)
        self.workers.stop(timeout_s=0.0 if failed else 30.0)
        if parallel is not None:
            if failed and self.backend == "nccl":
                _abort_groups()
            else:
                with contextlib.suppress(Exception):
                    torch.distributed.destroy_process_group()


def raise_failure(driver: TPDriver | None, exc: BaseException):
    """Re-raise `exc`, or the worker failure behind it, after stopping the workers."""
    if driver is None:
        raise exc
    error = driver.fail(exc)
    if error is exc:
        raise exc
    raise error from exc


@contextlib.contextmanager
def tp_startup(driver: TPDriver | None) -> Iterator[None]:
    """Around rank 0's startup: any error stops the workers and names a worker that caused it."""
    try:
        yield
    except BaseException as exc:
        raise_failure(driver, exc)


def start_tensor_parallel(args: Any, extra_plugins: Any = (),
                          config: TensorParallelConfig | None = None) -> TPDriver | None:
    """The driver of `--tp-size N` (spawns ranks 1..N-1); None at tp size 1. config: the resolved
    world size and backend (backplane.config.resolve_runtime); derived from `args` when None."""
    size = config.world_size if config is not None else args.tp_size
    if size > 1:
        refuse_inside_a_worker()
    return TPDriver(args, list(extra_plugins), config) if size > 1 else None


def refuse_inside_a_worker() -> None:
    """A worker re-importing a main module that builds an Engine at top level (no main guard) would
    start workers of its own: it exits at once, with a code rank 0 reports as that cause."""
    import multiprocessing as mp
    import os
    import sys

    from backplane.distributed.launcher import EXIT_MAIN_GUARD, MAIN_GUARD_HINT, WORKER_NAME

    if mp.current_process().name.startswith(WORKER_NAME):
        print(f"backplane: error: tensor-parallel worker {mp.current_process().name}: {MAIN_GUARD_HINT}",
              file=sys.stderr, flush=True)
        os._exit(EXIT_MAIN_GUARD)  # NOTE: SystemExit would become exit code 1 in the worker's bootstrap


def check_tp_settings(args: Any) -> None:
    """Refuse the combinations tensor parallelism does not serve, before anything starts."""
    if args.speculative_algorithm:
        raise ValueError(f"--tp-size {args.tp_size}: speculative decoding (--speculative-algorithm "
                         f"{args.speculative_algorithm}) is not supported with tensor parallelism; use --tp-size 1")
    if _wants_cuda(args) and torch.cuda.device_count() < args.tp_size:
        raise ValueError(f"--tp-size {args.tp_size}: expected at least {args.tp_size} CUDA devices, "
                         f"got {torch.cuda.device_count()}")


def _wants_cuda(args: Any) -> bool:
    return args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())


def _picklable(plugins: list[Any]) -> list[Any]:
    """Plugin objects for the workers: modules go by name, anything else must pickle."""
    import pickle
    import types

    out = []
    for plugin in plugins:
        if isinstance(plugin, types.ModuleType):
            out.append(plugin.__name__)
            continue
        try:
            pickle.dumps(plugin)
        except Exception as exc:  # noqa: BLE001 - any pickling failure means the same thing
            raise ValueError(f"--tp-size: plugin object {plugin!r} must reach the worker processes; expected an "
                             f"importable module or a picklable object, got one that fails to pickle ({exc})") from exc
        out.append(plugin)
    return out


def _after(failure: BaseException | None) -> str:
    return f" after an earlier failure: {failure}" if failure is not None else ""


def _abort_groups() -> None:
    with contextlib.suppress(Exception):
        from torch.distributed.distributed_c10d import _abort_process_group

        _abort_process_group()


def _shutdown_all() -> None:
    for driver in list(_ACTIVE):
        with contextlib.suppress(Exception):
            driver.shutdown()


atexit.register(_shutdown_all)
