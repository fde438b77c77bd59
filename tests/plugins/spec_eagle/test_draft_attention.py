"""DraftAttention: each draft pass runs under its own backend, bound for that pass only; eager
passes plan the batch's metadata, graph passes do not (their metadata is refreshed before replay)."""

from __future__ import annotations

import pytest

from backplane.models import ModelContext
from backplane.plugins.spec_eagle.draft_attention import DraftAttention


class Backend:
    def __init__(self, name: str):
        self.name, self.planned = name, []

    def init_forward_metadata(self, batch) -> None:
        self.planned.append(batch)


def test_each_pass_binds_and_plans_its_own_backend():
    ctx = ModelContext()
    extend, steps = Backend("extend"), [Backend("step0"), Backend("step1")]
    attention = DraftAttention(ctx, extend, steps, plan=True)
    with attention.extend_pass("extend batch"):
        assert ctx.attn_backend is extend
    with attention.step_pass(1, "step batch"):
        assert ctx.attn_backend is steps[1]
    assert ctx.attn_backend is None
    assert (extend.planned, steps[0].planned, steps[1].planned) == (["extend batch"], [], ["step batch"])


def test_a_graph_pass_binds_without_planning_and_a_failure_unbinds():
    ctx = ModelContext()
    extend, steps = Backend("extend"), [Backend("step0")]
    attention = DraftAttention(ctx, extend, steps, plan=False)
    with pytest.raises(RuntimeError, match="head failed"):
        with attention.step_pass(0, "batch"):
            assert ctx.attn_backend is steps[0]
            raise RuntimeError("head failed")
    assert ctx.attn_backend is None and steps[0].planned == [] and extend.planned == []
