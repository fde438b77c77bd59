"""Greedy outputs that may differ only at near-ties of the exact model.

Two bf16 pipelines (two attention backends, or verify against decode) round differently, so a
greedy choice between two tokens whose logits are within rounding noise may flip, and the
sequences part ways from there. A wrong kernel shows up differently: at the first differing
position the exact (fp32) model clearly prefers one of the two tokens. `check_divergences` asks
the fp32 transformers model for that margin at every first divergence and fails when one is
larger than a small fraction of the logits' spread.
"""

from __future__ import annotations

import torch

TIE_FRACTION = 0.05  # of the standard deviation of the reference logits at that position


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


@torch.inference_mode()
def check_divergences(model_dir: str, prompts, want, got, label: str) -> list[tuple[int, int, float]]:
    """Assert every divergence of `got` from `want` is a near-tie of the fp32 model; return them
    as (request, position, margin / logits std)."""
    from transformers import AutoModelForCausalLM

    found = []
    hf = None
    for i, (prompt, w, g) in enumerate(zip(prompts, want, got)):
        j = first_difference(w, g)
        if j is None:
            continue
        assert j < min(len(w), len(g)), f"{label}: request {i} has {len(g)} tokens, expected {len(w)}"
        if hf is None:
            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
        logits = hf(torch.tensor([list(prompt) + list(w[:j])], device="cuda")).logits[0, -1].float()
        margin = float((logits[w[j]] - logits[g[j]]).abs() / logits.std())
        found.append((i, j, margin))
    print(f"{label}: {len(prompts) - len(found)}/{len(prompts)} identical; divergences "
          f"(request, position, margin/std): {[(i, j, round(m, 4)) for i, j, m in found]}")
    wrong = [(i, j, m) for i, j, m in found if m > TIE_FRACTION]
    assert not wrong, f"{label}: greedy choices differ where the fp32 model is not near a tie: {wrong}"
    return found
