"""The multi-step tree draft (EAGLE-2 style), written once for eager runs and graph capture.

After the root, `topk` beams grow the tree for num_steps - 1 more steps. At step i every beam
feeds its depth-i token (at position num_cached + i, with its parent's draft feature) through the
draft head as one DECODE batch over per-beam rows of the draft's request pool; each beam proposes
its `topk` best children, scored by cumulative log-probability; every child becomes a candidate
node; the `topk` best children become the next beams. A beam row's columns after the root hold
fixed scratch slots, one per depth, so the beam's ancestors are *copied* into its scratch KV when
the beams are re-chosen: req_to_token never changes inside the loop, which keeps it capturable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backplane import ForwardBatch, ForwardMode

from .draft_attention import DraftAttention


@dataclass
class Beams:
    """The frontier, per request b and beam j (flattened index b * topk + j where flat).

    tokens: [bs * topk] int64; scores: [bs, topk] fp32 cumulative log-probs;
    features: [bs * topk, hidden], the draft feature of each beam's parent;
    node_ids: [bs, topk] int64, the beams' node ids (root 0, candidates 1..).
    """

    tokens: torch.Tensor
    scores: torch.Tensor
    features: torch.Tensor
    node_ids: torch.Tensor
    parent_beam: torch.Tensor | None = None  # [bs * topk] flat index of each beam's parent beam


@dataclass
class StepInputs:
    """What step i's DECODE batch reads (all [bs * topk]); seq_lens_cpu on the host."""

    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor


@dataclass
class Candidates:
    """Every drafted node but the root: tokens, scores [bs, num_candidates], parents (node ids)."""

    tokens: torch.Tensor
    scores: torch.Tensor
    parents: torch.Tensor

    def then(self, more: Candidates) -> Candidates:
        """These candidates followed by `more` (deeper ones), per request."""
        return Candidates(torch.cat([self.tokens, more.tokens], 1), torch.cat([self.scores, more.scores], 1),
                          torch.cat([self.parents, more.parents], 1))


def run_beam_steps(head, kv_pool, req_pool, beams: Beams, rows: torch.Tensor, scratch: torch.Tensor,
                   steps: list[StepInputs], topk: int, attention: DraftAttention) -> Candidates:
    """Grow the tree from the depth-1 beams; returns the candidates of depths 2..len(steps) + 1.

    rows: [bs * topk] the beams' rows in `req_pool`; scratch: [bs * topk, num_steps - 1] their
    scratch slots per depth (0 for padded beams). Step i runs under `attention.step_pass(i, batch)`.
    """
    bs = beams.scores.shape[0]
    next_id = 1 + topk  # root and the depth-1 nodes come first
    out_tokens, out_scores, out_parents = [], [], []
    for i, step in enumerate(steps):
        batch = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=bs * topk, input_ids=beams.tokens,
                             positions=step.positions, req_pool_indices=rows, seq_lens=step.seq_lens,
                             seq_lens_cpu=step.seq_lens_cpu, out_cache_loc=step.out_cache_loc,
                             req_to_token_pool=req_pool, token_to_kv_pool=kv_pool)
        with attention.step_pass(i, batch):
            features = head(beams.tokens, beams.features, step.positions, batch)  # [bs * topk, H]
        child_lp, child_tok = head.top_tokens(features, topk)  # [bs * topk, topk]
        # A child's score is its path's log-probability: parent score + its own log-prob.
        child_scores = (beams.scores.unsqueeze(-1) + child_lp.view(bs, topk, topk)).view(bs, topk * topk)
        child_tokens = child_tok.view(bs, topk * topk)
        out_tokens.append(child_tokens)
        out_scores.append(child_scores)
        out_parents.append(beams.node_ids.unsqueeze(-1).expand(bs, topk, topk).reshape(bs, topk * topk))
        if i + 1 < len(steps):
            beams = _next_beams(beams, child_tokens, child_scores, features, next_id, topk)
            _copy_ancestors(kv_pool, scratch, beams, i + 1, topk)
        next_id += topk * topk
    return Candidates(torch.cat(out_tokens, 1), torch.cat(out_scores, 1), torch.cat(out_parents, 1))


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best (log-probability, token) of each row: top-k of the logits minus the row's
    log-sum-exp, with no vocabulary-sized log-softmax written (nor kept by a captured graph)."""
    top, tokens = logits.topk(k, dim=-1)
    return top - torch.logsumexp(logits, dim=-1, keepdim=True), tokens


def _next_beams(beams: Beams, tokens, scores, features, first_id: int, topk: int) -> Beams:
    bs = scores.shape[0]
    best_scores, pick = scores.topk(topk, dim=-1)  # [bs, topk] indices into topk * topk children
    parent_beam = pick // topk + torch.arange(bs, device=pick.device).unsqueeze(1) * topk  # flat beam index
    return Beams(tokens=tokens.gather(1, pick).view(-1), scores=best_scores,
                 features=features[parent_beam.view(-1)], node_ids=pick + first_id,
                 parent_beam=parent_beam.view(-1))


def _copy_ancestors(kv_pool, scratch: torch.Tensor, beams: Beams, depth: int, topk: int) -> None:
    """Beam j now descends from beam parent_beam[j]: copy that beam's scratch K/V of depths 1..depth."""
    if topk == 1:
        return  # a single beam is its own parent
    src = scratch[beams.parent_beam, :depth].reshape(-1)
    dst = scratch[:, :depth].reshape(-1)
    for layer in range(kv_pool.num_layers):
        k, v = kv_pool.get_kv_buffer(layer)
        k[dst] = k[src]
        v[dst] = v[src]
