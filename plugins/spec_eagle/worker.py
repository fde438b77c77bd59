"""EagleWorker: the draft head drafts a top-k tree from the target's features; the shared path verifies.

Alignment: the draft sees token t_q at position q together with the target's feature of position
q - 1 (zeros at q = 0), so its KV for position q lives in the slot of the target's KV for q.
Per request, the view's `state` (an EagleState) keeps the target features of the positions before the root (the last
`window = num_steps + 1` of them at least, and every one the draft has not consumed yet). One step:
  1. draft extend over the pending tokens (the last one is the root, at position num_cached):
     in steady state over a fixed window of the last `window` tokens (window.py), else over
     exactly the pending ones (after a prefill, or for sequences shorter than the window),
  2. the root's top-k children, then num_steps - 1 beam steps (steps 1 and 2 are one CUDA graph
     in steady state when the target captures graphs),
  3. keep the num_draft_tokens - 1 best candidates by path log-probability as the tree,
  4. verify; the accepted nodes' target features join the kept ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backplane import ForwardBatch, ForwardMode
from backplane.layers import Attention
from backplane.models import ModelContext
from backplane.speculative import DraftTree, SpecRequest, SpecWorker

from .beams import Beams, Candidates, StepInputs, run_beam_steps
from .draft_attention import DraftAttention
from .head import load_eagle_head, load_token_map
from .memory import DraftMemory
from .options import resolve_options
from .select import select_tree
from .window import WindowInputs, run_window_draft


@dataclass
class EagleState:
    """start: the first position whose draft KV is missing (pending: start .. num_cached);
    features: [rows, hidden], the target features of positions num_cached - rows .. num_cached - 1
    (row -1 is zeros), rows >= num_cached + 1 - start."""

    start: int
    features: torch.Tensor


class EagleWorker(SpecWorker):
    capture_hidden = True
    # NOTE: the draft's input at position q is the target's feature at q - 1, which a request
    # starting at a cached prefix never computed; recomputing it would mean recomputing the prefix.
    prefix_cache_refusal = ("EAGLE drafts from the target's hidden states of every prompt token, "
                            "which a cached prefix does not have")

    def __init__(self, ctx):
        super().__init__(ctx)
        runner = ctx.runner
        self.options, flags = resolve_options(ctx.options, ctx.args)  # --eagle.* (or the deprecated flags)
        self.topk, self.num_steps = self.options.topk, self.options.num_steps
        self.window = self.num_steps + 1  # the most tokens one verify accepts (the tree's depth + 1)
        most = self.topk + (self.num_steps - 1) * self.topk ** 2
        if self.num_draft_tokens - 1 > most:
            raise ValueError(f"--speculative-num-draft-tokens {self.num_draft_tokens}: expected at most {most + 1} "
                             f"(1 + topk + (num_steps - 1) * topk^2 for {flags['topk']} {self.topk}, "
                             f"{flags['num_steps']} {self.num_steps})")
        self.model_ctx = ModelContext(ops=runner.model_ctx.ops, dtype=runner.dtype, device=runner.device,
                                      parallel=runner.model_ctx.parallel)
        self.head = load_eagle_head(self.options.draft_model, runner.model, self.model_ctx, flags["draft_model"])
        if self.options.token_map:
            ids = load_token_map(self.options.token_map, self.head.vocab_size, flags["token_map"])
            self.head.restrict_vocabulary(ids)
        infos = [m.info for m in self.head.modules() if isinstance(m, Attention)]
        self.memory = DraftMemory(runner, infos[0], self.topk, self.num_steps)
        mem = self.memory
        self.extend_backend = ctx.make_attention_backend("prefill", mem.req_pool, mem.kv_pool, infos)
        # One backend per beam step: a captured multi-step graph needs each step's own static buffers.
        self.step_backends = [ctx.make_attention_backend("decode", mem.req_pool, mem.kv_pool, infos)
                              for _ in range(self.num_steps - 1)]
        # Eager draft passes bind their backend and plan its metadata; the graphs have their own.
        self.attention = DraftAttention(self.model_ctx, self.extend_backend, self.step_backends, plan=True)
        self.graphs = None
        self._eager_inputs: WindowInputs | None = None

    @property
    def positions_ahead(self) -> int:
        """The beam steps reach num_steps positions past the root, the verified tree as deep."""
        return max(self.num_draft_tokens - 1, self.num_steps)

    def init_cuda_graphs(self) -> None:
        """Capture the steady-state draft as one graph per batch size, when the target runs graphs
        and the backends declare DRAFT_EXTEND and DECODE graphs."""
        target = self.runner
        if not target.graph_batch_sizes or not target.can_capture("draft_extend") or (
                self.num_steps > 1 and not target.can_capture("decode")):
            return
        from .graph import DraftGraphRunner

        self.graphs = DraftGraphRunner(self)
        self.graphs.capture()

    def window_inputs(self, max_bs: int) -> WindowInputs:
        runner = self.runner
        return WindowInputs(max_bs, self.window, self.topk, self.num_steps - 1, runner.model.hidden_size,
                            runner.dtype, runner.device, self.memory, runner.req_to_token_pool.req_to_token,
                            runner.req_to_token_pool.size - 1, runner.seq_len_fill_value)

    # -- prefill --------------------------------------------------------------------------------

    def after_prefill(self, reqs: list[SpecRequest[EagleState]], chunks: list[int], output) -> None:
        """Keep the target's features of the prefilled tokens (a first chunk starts a new state)."""
        offset = 0
        for req, n in zip(reqs, chunks):
            features = output.hidden_states[offset:offset + n]
            offset += n
            first = req.num_cached - n  # the scheduler has advanced num_cached already
            if first == 0 or req.state is None:
                zeros = features.new_zeros((1, features.shape[1]))  # no feature before position 0
                req.state = EagleState(start=0, features=zeros)
            req.state.features = torch.cat([req.state.features, features])

    # -- draft ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def draft(self, reqs: list[SpecRequest[EagleState]]) -> DraftTree:
        if all(self._fits_window(r) for r in reqs):
            if self.graphs is not None and self.graphs.can_run(len(reqs)):
                candidates = self.graphs.replay(reqs)
            else:
                candidates = self._draft_window_eager(reqs)
        else:
            candidates = self._draft_pending(reqs)
        roots = [r.last_token for r in reqs]
        if self.topk == 1:
            return self._chain(roots, candidates)
        return select_tree(roots, candidates, self.num_draft_tokens)

    def _chain(self, roots: list[int], candidates: Candidates) -> DraftTree:
        """With top-k 1 the candidates are a chain whose scores only fall with depth, so the best
        num_draft_tokens - 1 are the first ones (what select_tree keeps). The tokens stay on the
        device: verify reads them without waiting for the draft to finish."""
        n = self.num_draft_tokens
        root = torch.tensor(roots, dtype=torch.int64).to(candidates.tokens.device, non_blocking=True)
        tokens = torch.cat([root[:, None], candidates.tokens[:, : n - 1]], 1)
        parents = (torch.arange(n, dtype=torch.int64) - 1).expand(len(roots), n).clone()
        return DraftTree(None, parents, device_tokens=tokens)

    def _fits_window(self, req: SpecRequest[EagleState]) -> bool:
        state = req.state
        return state.features.shape[0] >= self.window and req.num_cached + 1 - state.start <= self.window

    def _draft_window_eager(self, reqs: list) -> Candidates:
        if self._eager_inputs is None or self._eager_inputs.max_bs < len(reqs):
            self._eager_inputs = self.window_inputs(max(len(reqs), 8))
        inputs = self._eager_inputs
        inputs.load(reqs, [r.state for r in reqs], len(reqs))
        return run_window_draft(self.head, inputs, len(reqs), self.attention)

    def _draft_pending(self, reqs: list) -> Candidates:
        """Extend over exactly the pending tokens, then the beam steps, eagerly."""
        root_tokens, root_scores, root_features = self._extend(reqs)
        candidates = Candidates(root_tokens, root_scores, torch.zeros_like(root_tokens))
        if self.num_steps == 1:
            return candidates
        beams = Beams(tokens=root_tokens.view(-1), scores=root_scores,
                      features=root_features.repeat_interleave(self.topk, 0),
                      node_ids=torch.arange(1, self.topk + 1, device=root_scores.device).expand(len(reqs), -1))
        mem = self.memory
        beam_rows = mem.beam_rows([r.row for r in reqs])
        more = run_beam_steps(self.head, mem.kv_pool, mem.req_pool, beams, beam_rows.to(self.runner.device),
                              mem.scratch(beam_rows).to(self.runner.device), self.beam_step_inputs(reqs),
                              self.topk, self.attention)
        return candidates.then(more)

    def _extend(self, reqs: list):
        """Draft extend over each request's pending tokens; the root's top-k (tokens, scores) and feature."""
        mem, device = self.memory, self.runner.device
        states = [r.state for r in reqs]
        starts, ends = [s.start for s in states], [r.num_cached + 1 for r in reqs]
        lens = [e - s for s, e in zip(starts, ends)]
        for st, n in zip(states, lens):
            assert st.features.shape[0] >= n, "EAGLE state out of step with the KV cache"
        positions = torch.cat([torch.arange(s, e) for s, e in zip(starts, ends)])
        target_rows = torch.repeat_interleave(torch.tensor([r.row for r in reqs]), torch.tensor(lens))
        slots = self.runner.req_to_token_pool.req_to_token[target_rows.to(device), positions.to(device)]
        beam_rows = mem.beam_rows([r.row for r in reqs])  # [bs * topk]
        for j in range(self.topk):
            mem.write_rows(target_rows * self.topk + j, positions, slots)
        self._write_scratch_columns(beam_rows, torch.tensor(ends) - 1)
        input_ids = [t for r, s in zip(reqs, starts) for t in r.tokens(s)]
        batch = _extend_batch(reqs, input_ids, positions, beam_rows[:: self.topk], starts, lens, slots, mem)
        pending = torch.cat([s.features[-n:] for s, n in zip(states, lens)])
        with self.attention.extend_pass(batch):
            features = self.head(batch.input_ids, pending, batch.positions, batch)
        root_features = features[torch.tensor(lens, device=device).cumsum(0) - 1]  # [bs, H]
        scores, tokens = self.head.top_tokens(root_features, self.topk)
        return tokens, scores, root_features

    def _write_scratch_columns(self, beam_rows: torch.Tensor, roots: torch.Tensor) -> None:
        if self.memory.depths == 0:
            return
        depths = torch.arange(1, self.memory.depths + 1)
        cols = (roots.repeat_interleave(self.topk)[:, None] + depths).view(-1)
        self.memory.write_rows(beam_rows.repeat_interleave(self.memory.depths), cols,
                               self.memory.scratch(beam_rows).view(-1))

    def beam_step_inputs(self, reqs: list) -> list[StepInputs]:
        """Positions, output slots and lengths of beam steps 1..num_steps-1 (host-known in advance)."""
        roots = torch.tensor([r.num_cached for r in reqs]).repeat_interleave(self.topk)
        scratch = self.memory.scratch(self.memory.beam_rows([r.row for r in reqs]))
        device = self.runner.device
        steps = []
        for i in range(1, self.num_steps):
            seq = (roots + i + 1).to(torch.int32)
            steps.append(StepInputs((roots + i).to(device), scratch[:, i - 1].to(device), seq.to(device), seq))
        return steps

    # -- after verify ---------------------------------------------------------------------------

    def after_verify(self, reqs: list[SpecRequest[EagleState]], tree: DraftTree, accepted: list, output) -> None:
        hidden = output.hidden_states.view(len(reqs), tree.num_nodes, -1)
        for b, (req, acc) in enumerate(zip(reqs, accepted)):
            start = req.num_cached - len(acc.path) + 1  # the old root's position + 1
            path = torch.tensor(acc.path).to(hidden.device, non_blocking=True)
            # The old features end at the old root - 1; the path's continue from the old root.
            kept = torch.cat([req.state.features, hidden[b].index_select(0, path)])
            req.state = EagleState(start=start, features=kept[-max(len(acc.path), self.window):])


def _extend_batch(reqs, input_ids, positions, rows, starts, lens, slots, mem: DraftMemory) -> ForwardBatch:
    device = mem.device
    seq_cpu = torch.tensor([s + n for s, n in zip(starts, lens)], dtype=torch.int32)
    batch = ForwardBatch(forward_mode=ForwardMode.DRAFT_EXTEND, batch_size=len(reqs),
                         input_ids=torch.tensor(input_ids, device=device), positions=positions.to(device),
                         req_pool_indices=rows.to(device), seq_lens=seq_cpu.to(device), seq_lens_cpu=seq_cpu,
                         out_cache_loc=slots.to(torch.int64), req_to_token_pool=mem.req_pool,
                         token_to_kv_pool=mem.kv_pool)
    batch.set_extend_lens(starts, lens)
    return batch
