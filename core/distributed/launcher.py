"""Starting tensor-parallel worker processes and noticing when one fails.

Rank 0 (the Engine's process) starts ranks 1..N-1 with the 'forkserver' start method: like 'spawn'
each worker begins from a fresh interpreter that never touched CUDA, but it is forked from a
server that imported torch and transformers once (preload.py), so the second engine of a program
starts its workers in a fraction of a second. A worker takes rank 0's environment as it is at
start (the server's is older). Every process joins the same two process groups over a free TCP
port on 127.0.0.1. A worker reports
("ready", rank, None) once its model runner is built, or ("error", rank, cause) when it fails,
on a multiprocessing queue; WorkerHandles turns a failure or an exit into WorkerFailedError.
"""

from __future__ import annotations

import logging
import os
import queue as queue_module
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

logger = logging.getLogger(__name__)

# Multicast (NVLS) stays off on the shared GPU machines; set in every process we start.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
START_TIMEOUT_S = 900.0  # spawning, joining the groups and loading the weights of every rank
COLLECTIVE_TIMEOUT_S = 600.0  # one collective of the tensor group (a forward's all-reduce)
IDLE_TIMEOUT = timedelta(days=30)  # workers wait on the host group between generate calls
POLL_S = 0.05
START_METHOD = "forkserver"
WORKER_NAME = "backplane-tp-rank"  # + the rank: the worker processes' names
EXIT_MAIN_GUARD = 3  # a worker that found itself re-running the script that creates the Engine
MAIN_GUARD_HINT = ("it re-ran the script that creates the Engine, as every tensor-parallel worker imports the "
                   "main module: put the Engine under `if __name__ == \"__main__\":`")
PRELOAD = ["backplane.distributed.preload"]


class WorkerFailedError(RuntimeError):
    """A tensor-parallel worker failed to start or died; the message names the rank and the cause."""


@dataclass
class WorkerConfig:
    """Everything a worker needs, sent pickled to the spawned process."""

    rank: int
    world_size: int
    port: int
    backend: str  # of the tensor group: "nccl" on GPU, "gloo" on CPU
    args: Any  # EngineArgs
    extra_plugins: list[Any] = field(default_factory=list)  # plugin objects, or module names to import
    num_threads: int = 0  # torch's intra-op threads (0: torch's default)
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))  # rank 0's, at start


def apply_env(env: dict[str, str] | None = None) -> None:
    """Environment every rank needs before touching torch.distributed (`env`: replaces the rest)."""
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    os.environ.update(MULTICAST_OFF)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # single host: stay on loopback


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_groups(rank: int, world_size: int, port: int, backend: str):
    """Join the tensor group (the default group) and a gloo host group; returns a ParallelContext."""
    import torch.distributed as dist

    from backplane.layers.parallel import ParallelContext

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    cpu_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return ParallelContext(tp_rank=rank, tp_size=world_size, group=None, cpu_group=cpu_group)


class WorkerHandles:
    """The spawned worker processes of rank 0 and their report queue."""

    def __init__(self, processes: dict[int, Any], reports: Any):
        self.processes = processes  # rank -> multiprocessing.Process
        self.reports = reports
        self.errors: dict[int, str] = {}
        self.ready: set[int] = set()

    @classmethod
    def spawn(cls, target: Callable, configs: list[WorkerConfig]) -> WorkerHandles:
        import torch.multiprocessing as mp

        ctx = mp.get_context(START_METHOD)
        if START_METHOD == "forkserver":
            ctx.set_forkserver_preload(PRELOAD)  # only read when the server starts (once per program)
        reports = ctx.Queue()
        processes = {}
        for config in configs:
            process = ctx.Process(target=target, args=(config, reports), name=f"{WORKER_NAME}{config.rank}",
                                  daemon=True)
            process.start()
            processes[config.rank] = process
        return cls(processes, reports)

    def _drain(self) -> None:
        while True:
            try:
                kind, rank, detail = self.reports.get_nowait()
            except (queue_module.Empty, OSError, ValueError):  # empty, or closed by stop()
                return
            if kind == "ready":
                self.ready.add(rank)
            else:
                self.errors.setdefault(rank, detail)

    def failure(self, grace_s: float = 0.0) -> WorkerFailedError | None:
        """The first failed or exited worker as an error, waiting up to `grace_s` for one to show."""
        deadline = time.monotonic() + grace_s
        while True:
            self._drain()
            for rank, process in sorted(self.processes.items()):
                if rank in self.errors:
                    return WorkerFailedError(f"tensor-parallel worker rank {rank} failed: {self.errors[rank]}")
                if process.exitcode is not None:
                    self._drain()  # the report is written before the process exits
                    cause = self.errors.get(rank) or _exit_cause(process.exitcode)
                    return WorkerFailedError(f"tensor-parallel worker rank {rank} failed: {cause}")
            if time.monotonic() >= deadline:
                return None
            time.sleep(POLL_S)

    def raise_if_failed(self, grace_s: float = 0.0) -> None:
        error = self.failure(grace_s)
        if error is not None:
            raise error

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until every worker reported ready; raises WorkerFailedError on a failure or the timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.raise_if_failed()
            if self.ready >= set(self.processes):
                return
            if time.monotonic() >= deadline:
                missing = sorted(set(self.processes) - self.ready)
                raise WorkerFailedError(f"tensor-parallel worker ranks {missing} not ready after {timeout_s:.0f} s")
            time.sleep(POLL_S)

    def run_polled(self, fn: Callable[[], Any], what: str, timeout_s: float = START_TIMEOUT_S) -> Any:
        """fn() in a helper thread while watching the workers: a worker failure or the timeout
        raises at once instead of waiting for fn (e.g. joining a group a dead worker never joins)."""
        result: dict[str, Any] = {}

        def call() -> None:
            try:
                result["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                result["error"] = exc

        thread = threading.Thread(target=call, name=f"backplane-tp-{what}", daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout_s
        while thread.is_alive():
            thread.join(POLL_S)
            self.raise_if_failed()
            if time.monotonic() >= deadline:
                raise WorkerFailedError(f"tensor parallelism: {what} did not finish within {timeout_s:.0f} s")
        if "error" in result:
            raise result["error"]
        return result.get("value")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Join every worker (they were told to stop), terminating those that do not exit in time."""
        deadline = time.monotonic() + timeout_s
        for process in self.processes.values():
            process.join(max(0.0, deadline - time.monotonic()))
        for rank, process in self.processes.items():
            if process.is_alive():
                logger.warning("tensor-parallel worker rank %d did not stop; terminating it", rank)
                process.terminate()
                process.join(5.0)
            if process.is_alive():
                process.kill()
                process.join(5.0)
        self.reports.close()


def _exit_cause(exitcode: int) -> str:
    if exitcode < 0:
        return f"the process was killed by signal {-exitcode}"
    if exitcode == EXIT_MAIN_GUARD:
        return MAIN_GUARD_HINT
    return f"the process exited with code {exitcode} without reporting an error"
