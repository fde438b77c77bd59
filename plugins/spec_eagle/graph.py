"""DraftGraphRunner: the EAGLE beam steps captured as one CUDA graph per padded batch size.

Static inputs (copied in before each replay): the depth-1 beams (tokens, scores, features), the
beam rows, their scratch slots, and per step the positions, output slots and sequence lengths.
Each step's attention backend is its own instance with its own static buffers, refreshed on the
host before the single replay. Padded beams read and write only the dump slot 0. The graphs are
captured into the process's shared pool (the target's graphs are captured first and their memory
is reused), unless `pool` says otherwise.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from backplane.batch import ForwardBatch, ForwardMode
from backplane.speculative.draft_parts import graph_pool, padded_size

from .beams import Beams, Candidates, StepInputs, run_beam_steps


class _Static:
    def __init__(self, max_beams: int, max_bs: int, topk: int, depths: int, hidden: int, dtype, device):
        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, device=device)

        self.tokens, self.rows = zeros(max_beams), zeros(max_beams)
        self.features = zeros(max_beams, hidden, dtype=dtype)
        self.scores = zeros(max_bs, topk, dtype=torch.float32)
        self.node_ids = torch.arange(1, topk + 1, device=device).repeat(max_bs, 1)
        self.scratch = zeros(max_beams, depths)
        self.positions = [zeros(max_beams) for _ in range(depths)]
        self.out_cache_loc = [zeros(max_beams) for _ in range(depths)]
        self.seq_lens = [zeros(max_beams, dtype=torch.int32) for _ in range(depths)]


class DraftGraphRunner:
    def __init__(self, worker, pool: Any = None):
        self.worker = worker
        runner = worker.runner
        self.topk, self.depths = worker.topk, worker.num_steps - 1
        self.sizes = list(runner.graph_runner.sizes)
        self.fill = runner.seq_len_fill_value
        self.pad_rows = worker.memory.beam_rows([runner.req_to_token_pool.size - 1])  # [topk]
        self.pool = pool if pool is not None else graph_pool()
        max_beams = max(self.sizes) * self.topk
        self.static = _Static(max_beams, max(self.sizes), self.topk, self.depths, runner.model.hidden_size,
                              runner.dtype, runner.device)
        for backend in worker.step_backends:
            backend.init_graph_state(max_beams, max_beams)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Candidates] = {}
        self.graph_memory_bytes = 0
        self.capture_seconds = 0.0

    def can_run(self, batch_size: int) -> bool:
        return padded_size(batch_size, self.sizes) in self.graphs

    # -- capture --------------------------------------------------------------------------------

    def capture(self) -> None:
        from backplane.graph_runner import pool_bytes

        pool_before, start = pool_bytes(self.pool), time.perf_counter()
        for bs in reversed(self.sizes):
            self._capture_one(bs)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        self.graph_memory_bytes = pool_bytes(self.pool) - pool_before  # growth of the pool it captures into

    def _capture_one(self, bs: int) -> None:
        n = bs * self.topk
        s = self.static
        s.rows[:n].copy_(self.pad_rows.repeat(bs))
        s.scratch[:n].zero_()
        for i in range(self.depths):
            s.positions[i][:n].zero_()
            s.out_cache_loc[i][:n].zero_()
            s.seq_lens[i][:n].fill_(self.fill)
        seq_cpu = torch.full((n,), self.fill, dtype=torch.int32)
        for i, backend in enumerate(self.worker.step_backends):
            backend.init_metadata_for_capture(("eagle-draft", bs, i), self._step_batch(i, n, seq_cpu))
        for _ in range(2):  # warm up
            self._run(bs, seq_cpu)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._run(bs, seq_cpu)
        torch.cuda.synchronize()
        self.graphs[bs], self.outputs[bs] = graph, out

    def _steps(self, n: int, seq_cpu: list[torch.Tensor] | torch.Tensor) -> list[StepInputs]:
        s = self.static
        cpu = seq_cpu if isinstance(seq_cpu, list) else [seq_cpu] * self.depths
        return [StepInputs(s.positions[i][:n], s.out_cache_loc[i][:n], s.seq_lens[i][:n], cpu[i])
                for i in range(self.depths)]

    def _step_batch(self, i: int, n: int, seq_cpu: torch.Tensor) -> ForwardBatch:
        s, mem = self.static, self.worker.memory
        return ForwardBatch(ForwardMode.DECODE, n, s.tokens[:n], s.positions[i][:n], s.rows[:n], s.seq_lens[i][:n],
                            seq_cpu, s.out_cache_loc[i][:n], mem.req_pool, mem.kv_pool)

    def _run(self, bs: int, seq_cpu) -> Candidates:
        n, s, w = bs * self.topk, self.static, self.worker
        beams = Beams(s.tokens[:n], s.scores[:bs], s.features[:n], s.node_ids[:bs])

        def prepare(i: int, batch: ForwardBatch) -> None:
            w.model_ctx.attn_backend = w.step_backends[i]

        return run_beam_steps(w.head, w.memory.kv_pool, w.memory.req_pool, beams, s.rows[:n], s.scratch[:n],
                              self._steps(n, seq_cpu), self.topk, prepare)

    # -- replay ---------------------------------------------------------------------------------

    def replay(self, reqs: list, beams: Beams) -> Candidates:
        bs, s, mem = len(reqs), self.static, self.worker.memory
        pbs = padded_size(bs, self.sizes)
        n, pn = bs * self.topk, pbs * self.topk
        s.tokens[:n].copy_(beams.tokens)
        s.tokens[n:pn].zero_()
        s.scores[:bs].copy_(beams.scores)
        s.features[:n].copy_(beams.features)
        rows = mem.beam_rows([r.row for r in reqs])
        s.rows[:pn].copy_(torch.cat([rows, self.pad_rows.repeat(pbs - bs)]))
        s.scratch[:n].copy_(mem.scratch(rows))
        s.scratch[n:pn].zero_()
        pad = torch.full((pn - n,), self.fill, dtype=torch.int32)
        seq_cpu = []
        for i, step in enumerate(self.worker.beam_step_inputs(reqs)):
            s.positions[i][:n].copy_(step.positions)
            s.out_cache_loc[i][:n].copy_(step.out_cache_loc)
            s.seq_lens[i][:n].copy_(step.seq_lens)
            s.positions[i][n:pn].zero_()
            s.out_cache_loc[i][n:pn].zero_()
            s.seq_lens[i][n:pn].fill_(self.fill)
            seq_cpu.append(torch.cat([step.seq_lens_cpu, pad]))
            self.worker.step_backends[i].init_metadata_for_replay(("eagle-draft", pbs, i),
                                                                  self._step_batch(i, pn, seq_cpu[i]))
        self.graphs[pbs].replay()
        out = self.outputs[pbs]
        return Candidates(out.tokens[:bs], out.scores[:bs], out.parents[:bs])
