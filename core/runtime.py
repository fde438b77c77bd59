"""build_runtime: a rank's model runner and what joins it, built in the one order that works.

Both the Engine (rank 0) and a tensor-parallel worker (ranks 1..N-1) build through here:

1. the model runner (model, pools, custom ops, attention backends);
2. LoRA (`attach_lora`): it wraps the model's linear layers and joins the graph key, so it must
   exist before any graph is captured;
3. speculation (rank 0 only): the draft worker reads the runner, and its verify batches go
   through the same participants as the scheduler's (each request keeps its adapter);
4. `ready(lora)`: the tensor-parallel rendezvous (rank 0 waits for every worker's runner, a
   worker reports that its runner is built), before any collective of graph capture;
5. CUDA graphs: the target's, then the draft's (which share the target's graph pool).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class Runtime:
    """One rank's built parts: the runner, the LoRA manager (None without adapters) and the
    speculative worker (None without --speculative-algorithm)."""

    runner: Any
    lora: Any = None
    spec_worker: Any = None

    @property
    def participants(self) -> list[Any]:
        """The scheduler's participants (the LoRA manager, when there is one)."""
        return [self.lora] if self.lora else []


def build_runtime(args: Any, plugin_set: Any, parallel: Any = None, *, router: Any = None,
                  speculative: bool = True, ready: Callable[[Any], None] | None = None, pool: Any = None,
                  source: Any = None) -> Runtime:
    """Build the runner, LoRA, speculation, then call `ready(lora_manager)`, then capture graphs.

    args: EngineArgs; plugin_set: the loaded plugins (already configured); parallel: the
    ParallelContext of tensor parallelism (None at tp size 1); router: rank 0's ForwardRouter (the
    TP driver). speculative=False builds no draft worker (tensor-parallel workers). pool: the resolved
    PoolConfig (backplane.config; resolved from args when None); source: the ModelSource already read
    (its config.json read once per process; read from args when None).
    """
    from backplane.executor.model_runner import ModelRunner
    from backplane.lora.manager import attach_lora
    from backplane.speculative.factory import build_spec_worker

    runner = ModelRunner(args, plugin_set, parallel, router=router, pool=pool, source=source)
    runtime = Runtime(runner, attach_lora(runner))
    if speculative:
        runtime.spec_worker = build_spec_worker(args, plugin_set, runner, runtime.participants)
    if ready is not None:
        ready(runtime.lora)
    runner.init_cuda_graphs()
    if runtime.spec_worker is not None:
        runtime.spec_worker.init_cuda_graphs()
    return runtime
