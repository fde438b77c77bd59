"""The steady-state draft: a fixed window of tokens per request, then the beam steps.

After the first step of a request, the tokens the draft has not seen yet are the ones the last
verify accepted: at most `window = num_steps + 1` of them, the root last. Instead of an extend of
a different length per request, every request re-runs the draft over its last `window` positions
(root - window + 1 .. root). Positions the draft had already seen get the same K/V again (same
token, same target feature), so the result is unchanged, and the batch has one shape per batch
size: a DRAFT_EXTEND of `window` tokens a request, which a CUDA graph can hold. The draft extend,
the root's top-k and the beam steps are then one graph (DraftGraphRunner) or one eager call here.

`WindowInputs` lays out every integer the draft reads in one flat int64 and one flat int32 tensor,
filled on the host and sent in two copies; the device then derives the target slots and writes
the draft's request rows (which the attention backends read while planning).
"""

from __future__ import annotations

import torch

from backplane import ForwardBatch, ForwardMode

from .beams import Beams, Candidates, StepInputs, run_beam_steps
from .draft_attention import DraftAttention


class WindowInputs:
    """Buffers for up to `max_bs` requests (graph replays read fixed views of them).

    int64 fields: ids, positions, out_cache_loc [max_bs * window]; target_rows, ext_rows [max_bs];
    beam_rows [max_beams]; step_positions, step_loc [depths, max_beams]. int32: ext_seq [max_bs],
    step_seq [depths, max_beams]. Requests past the batch are padding: they read and write slot 0.
    """

    def __init__(self, max_bs: int, window: int, topk: int, depths: int, hidden: int, dtype, device,
                 memory, target_req_to_token: torch.Tensor, pad_target_row: int, fill: int):
        self.max_bs, self.window, self.topk, self.depths = max_bs, window, topk, depths
        self.memory, self.target_r2t, self.device = memory, target_req_to_token, torch.device(device)
        self.pad_target_row, self.fill = pad_target_row, fill
        self.pad_beam_rows = memory.beam_rows([pad_target_row])  # [topk]
        nt, nb = max_bs * window, max_bs * topk
        sizes64 = {"ids": nt, "positions": nt, "target_rows": max_bs, "ext_rows": max_bs, "beam_rows": nb,
                   "step_positions": depths * nb, "step_loc": depths * nb}
        sizes32 = {"ext_seq": max_bs, "step_seq": depths * nb}
        pin = self.device.type == "cuda"
        self.host64, self.dev64, f64 = _flat(sizes64, torch.int64, device, pin)
        self.host32, self.dev32, f32 = _flat(sizes32, torch.int32, device, pin)
        self.h = {**f64[0], **f32[0]}  # host views
        self.d = {**f64[1], **f32[1]}  # device views
        for name in ("step_positions", "step_loc", "step_seq"):
            self.h[name], self.d[name] = self.h[name].view(depths, nb), self.d[name].view(depths, nb)
        self.out_cache_loc = torch.zeros(nt, dtype=torch.int64, device=device)
        self.features = torch.zeros(nt, hidden, dtype=dtype, device=device)
        self.node_ids = torch.arange(1, topk + 1, device=device).repeat(max_bs, 1)
        self.step_tokens = torch.zeros(nb, dtype=torch.int64, device=device)  # stand-in for planning
        self.ext_seq_cpu = torch.full((max_bs,), max(fill, window), dtype=torch.int32)
        self.step_seq_cpu = torch.full((depths, nb), fill, dtype=torch.int32)

    # -- host ---------------------------------------------------------------------------------

    def load(self, reqs: list, states: list | None, pbs: int) -> None:
        """Fill the buffers for `reqs` (SpecRequests) padded to `pbs` requests (no request: padding only), copy
        them to the device and write the draft's request rows; `states` give the features."""
        bs, T, k, D = len(reqs), self.window, self.topk, self.depths
        h, n, pn = self.h, bs * k, pbs * k
        if bs > 0:
            roots = torch.tensor([r.num_cached for r in reqs])
            target_rows = torch.tensor([r.row for r in reqs])
            h["ids"][: bs * T] = torch.tensor([r.tokens(r.num_tokens - T) for r in reqs]).view(-1)
            h["positions"][: bs * T] = (roots[:, None] + torch.arange(1 - T, 1)).view(-1)
            h["target_rows"][:bs] = target_rows
            beam_rows = self.memory.beam_rows(target_rows.tolist())
            h["ext_rows"][:bs] = beam_rows[::k]
            h["beam_rows"][:n] = beam_rows
            h["ext_seq"][:bs] = roots + 1
            self.ext_seq_cpu[:bs] = roots + 1
            if D:
                depth = torch.arange(1, D + 1)[:, None]
                beam_roots = roots.repeat_interleave(k)[None, :]
                h["step_positions"][:, :n] = beam_roots + depth
                h["step_loc"][:, :n] = self.memory.scratch(beam_rows).t()
                h["step_seq"][:, :n] = beam_roots + depth + 1
                self.step_seq_cpu[:, :n] = beam_roots + depth + 1
        if pbs > bs:  # padding: positions 0.., the pad rows, slot 0
            h["ids"][bs * T: pbs * T] = 0
            h["positions"][bs * T: pbs * T] = torch.arange(T).repeat(pbs - bs)
            h["ext_rows"][bs:pbs] = self.pad_beam_rows[0]
            h["beam_rows"][n:pn] = self.pad_beam_rows.repeat(pbs - bs)
            h["ext_seq"][bs:pbs] = max(self.fill, T)
            self.ext_seq_cpu[bs:pbs] = max(self.fill, T)
            if D:
                h["step_positions"][:, n:pn] = 0
                h["step_loc"][:, n:pn] = 0
                h["step_seq"][:, n:pn] = self.fill
                self.step_seq_cpu[:, n:pn] = self.fill
        self.dev64.copy_(self.host64, non_blocking=True)
        self.dev32.copy_(self.host32, non_blocking=True)
        if bs > 0:
            torch.cat([s.features[-T:] for s in states], out=self.features[: bs * T])
        self._write_rows(bs, pbs)

    def _write_rows(self, bs: int, pbs: int) -> None:
        """Target slots of the window, and the draft's rows: the window for every beam, then each
        beam's scratch slot per depth (columns root + 1 ..). Padding writes no row and only slot 0
        (its rows may be a live request's)."""
        d, T, k, D = self.d, self.window, self.topk, self.depths
        n = bs * k
        self.out_cache_loc[bs * T: pbs * T].zero_()
        if bs == 0:
            return
        positions = d["positions"][: bs * T].view(bs, T)
        slots = self.target_r2t[d["target_rows"][:bs, None], positions]  # [bs, T] int32
        self.out_cache_loc[: bs * T].copy_(slots.view(-1))
        draft_r2t = self.memory.req_pool.req_to_token
        beams = d["beam_rows"][:n].view(bs, k, 1).expand(bs, k, T)
        draft_r2t[beams, positions[:, None, :].expand(bs, k, T)] = slots[:, None, :].expand(bs, k, T)
        if D:
            draft_r2t[d["beam_rows"][:n].expand(D, n), d["step_positions"][:, :n]] = d["step_loc"][:, :n].to(torch.int32)

    # -- batches ------------------------------------------------------------------------------

    def extend_batch(self, pbs: int) -> ForwardBatch:
        """The DRAFT_EXTEND of `window` tokens a request (no extend lengths: uniform, causal)."""
        d, nt, mem = self.d, pbs * self.window, self.memory
        return ForwardBatch(forward_mode=ForwardMode.DRAFT_EXTEND, batch_size=pbs, input_ids=d["ids"][:nt],
                            positions=d["positions"][:nt], req_pool_indices=d["ext_rows"][:pbs],
                            seq_lens=d["ext_seq"][:pbs], seq_lens_cpu=self.ext_seq_cpu[:pbs].clone(),
                            out_cache_loc=self.out_cache_loc[:nt], req_to_token_pool=mem.req_pool,
                            token_to_kv_pool=mem.kv_pool)

    def steps(self, pbs: int) -> list[StepInputs]:
        d, pn = self.d, pbs * self.topk
        return [StepInputs(d["step_positions"][i, :pn], d["step_loc"][i, :pn], d["step_seq"][i, :pn],
                           self.step_seq_cpu[i, :pn].clone()) for i in range(self.depths)]

    def step_batch(self, i: int, pbs: int) -> ForwardBatch:
        """Step i's DECODE batch as the attention backends see it (its tokens come from the beams)."""
        d, pn, mem = self.d, pbs * self.topk, self.memory
        return ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=pn, input_ids=self.step_tokens[:pn],
                            positions=d["step_positions"][i, :pn], req_pool_indices=d["beam_rows"][:pn],
                            seq_lens=d["step_seq"][i, :pn], seq_lens_cpu=self.step_seq_cpu[i, :pn].clone(),
                            out_cache_loc=d["step_loc"][i, :pn], req_to_token_pool=mem.req_pool,
                            token_to_kv_pool=mem.kv_pool)


def _flat(sizes: dict[str, int], dtype, device, pin: bool):
    """One host and one device tensor holding every field back to back, and their views by name."""
    total = sum(sizes.values())
    host = torch.zeros(total, dtype=dtype, pin_memory=pin)
    dev = torch.zeros(total, dtype=dtype, device=device)
    views: tuple[dict, dict] = ({}, {})
    offset = 0
    for name, size in sizes.items():
        views[0][name], views[1][name] = host[offset:offset + size], dev[offset:offset + size]
        offset += size
    return host, dev, views


def run_window_draft(head, inputs: WindowInputs, pbs: int, attention: DraftAttention) -> Candidates:
    """Draft extend over the window, the root's top-k children, then the beam steps; every drafted
    node but the root, [pbs, topk + (num_steps - 1) * topk^2]. Each forward runs under its own
    backend of `attention`."""
    T, k = inputs.window, inputs.topk
    batch = inputs.extend_batch(pbs)
    with attention.extend_pass(batch):
        features = head(batch.input_ids, inputs.features[: pbs * T], batch.positions, batch)  # [pbs * T, H]
    root = features.view(pbs, T, -1)[:, -1]  # the root is the last token of each window
    scores, tokens = head.top_tokens(root, k)
    first = Candidates(tokens, scores, torch.zeros_like(tokens))
    if inputs.depths == 0:
        return first
    beams = Beams(tokens=tokens.reshape(-1), scores=scores, features=root.repeat_interleave(k, 0),
                  node_ids=inputs.node_ids[:pbs])
    d = inputs.d
    more = run_beam_steps(head, inputs.memory.kv_pool, inputs.memory.req_pool, beams, d["beam_rows"][: pbs * k],
                          d["step_loc"][:, : pbs * k].t(), inputs.steps(pbs), k, attention)
    return first.then(more)
