"""Speculative algorithm "ngram": prompt-lookup drafting, no draft model."""

from backplane import SpecAlgorithmSpec, hookimpl


def _factory(ctx):
    from backplane.plugins.spec_ngram.worker import NgramWorker

    return NgramWorker(ctx)


@hookimpl
def backplane_register_spec_algorithms(register):
    register(SpecAlgorithmSpec(
        name="ngram", factory=_factory,
        description="prompt lookup: propose what followed the last n tokens earlier in the text",
        # LoRA: drafting reads no model; verify runs each request under its adapter.
        needs_draft_model=False, supports_lora=True, supports_sampling=False,
    ))
