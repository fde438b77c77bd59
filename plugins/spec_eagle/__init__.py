"""Speculative algorithm "eagle": an EAGLE draft head drafts a top-k tree from the target's features.

Its options are the settings group "eagle" (`--eagle.draft-model`, `--eagle.num-steps`,
`--eagle.topk`, `--eagle.token-map`; see options.py).
"""

from backplane import SpecAlgorithmSpec, hookimpl

from .options import GROUP, EagleOptions


def _factory(ctx):
    from backplane.plugins.spec_eagle.worker import EagleWorker

    return EagleWorker(ctx)


@hookimpl
def backplane_register_spec_algorithms(register):
    register(SpecAlgorithmSpec(
        name="eagle", factory=_factory,
        description="EAGLE draft head (fc + one decoder layer) drafting a top-k tree, one CUDA graph",
        # LoRA (as SGLang does): adapters apply to the target only (prefill and verify); the draft
        # head runs without them, on the target's adapted hidden states.
        needs_draft_model=True, supports_lora=True, supports_sampling=False,
    ))


@hookimpl
def backplane_register_settings(register):
    register(GROUP, EagleOptions)
