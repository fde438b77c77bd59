"""DraftGraphRunner: the whole steady-state EAGLE draft as one CUDA graph per padded batch size.

One graph holds the draft extend over each request's window (a DRAFT_EXTEND of num_steps + 1
tokens a request), the root's top-k and the num_steps - 1 beam steps (backplane's spec_eagle
window.py). Its inputs are the views of one WindowInputs, filled by two host-to-device copies
before each replay; the extend's attention backend and each beam step's own backend (each step
needs its own static buffers) are refreshed on the host before the single replay. Padded
requests write only the dump slot 0. The graphs are captured into the process's shared pool (the
target's graphs are captured first and their memory is reused), unless `pool` says otherwise.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from backplane import capture_graph
from backplane.speculative import graph_pool, padded_size

from .beams import Candidates
from .draft_attention import DraftAttention
from .window import run_window_draft


class DraftGraphRunner:
    def __init__(self, worker, pool: Any = None):
        self.worker = worker
        runner = worker.runner
        self.topk, self.window = worker.topk, worker.window
        self.sizes = list(runner.graph_batch_sizes)
        self.pool = pool if pool is not None else graph_pool()
        max_bs = max(self.sizes)
        self.inputs = worker.window_inputs(max_bs)
        # Captured passes bind the same backends but never plan: _refresh does, on the host.
        self.attention = DraftAttention(worker.model_ctx, worker.extend_backend, worker.step_backends, plan=False)
        worker.extend_backend.init_graph_state(max_bs, max_bs * self.window)
        for backend in worker.step_backends:
            backend.init_graph_state(max_bs * self.topk, max_bs * self.topk)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Candidates] = {}
        self.graph_memory_bytes = 0
        self.capture_seconds = 0.0

    def can_run(self, batch_size: int) -> bool:
        return padded_size(batch_size, self.sizes) in self.graphs

    # -- capture --------------------------------------------------------------------------------

    def capture(self) -> None:
        from backplane.speculative import pool_bytes

        pool_before, start = pool_bytes(self.pool), time.perf_counter()
        for bs in reversed(self.sizes):
            self._capture_one(bs)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        self.graph_memory_bytes = pool_bytes(self.pool) - pool_before  # growth of the pool it captures into

    def _capture_one(self, bs: int) -> None:
        self.inputs.load([], None, bs)  # padding only
        self._refresh(bs, capture=True)
        self.graphs[bs], self.outputs[bs] = capture_graph(lambda: self._run(bs), self.pool)

    def _refresh(self, bs: int, capture: bool = False) -> None:
        """Bind (capture) or refresh (replay) the extend's and every beam step's attention metadata."""
        w, x = self.worker, self.inputs
        batches = [(w.extend_backend, ("eagle-draft-extend", bs), x.extend_batch(bs))]
        batches += [(b, ("eagle-draft-step", bs, i), x.step_batch(i, bs)) for i, b in enumerate(w.step_backends)]
        for backend, key, batch in batches:
            if capture:
                backend.init_metadata_for_capture(key, batch)
            else:
                backend.init_metadata_for_replay(key, batch)

    def _run(self, bs: int) -> Candidates:
        return run_window_draft(self.worker.head, self.inputs, bs, self.attention)

    # -- replay ---------------------------------------------------------------------------------

    def replay(self, reqs: list) -> Candidates:
        bs = len(reqs)
        pbs = padded_size(bs, self.sizes)
        self.inputs.load(reqs, [r.state for r in reqs], pbs)
        self._refresh(pbs)
        self.graphs[pbs].replay()
        out = self.outputs[pbs]
        return Candidates(out.tokens[:bs], out.scores[:bs], out.parents[:bs])
