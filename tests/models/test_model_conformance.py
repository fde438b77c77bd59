"""The Llama family passes backplane.testing.model_conformance, and the suite fails on planted bugs."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from backplane import hookimpl
from backplane.contracts import ForwardMode
from backplane.layers import RotaryEmbedding
from backplane.plugin.registry import ModelSpec
from backplane.testing import model_conformance
from backplane.testing.model_conformance import check_model, save_reference

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

# One line per family member, as a plugin's own test file would have it.
test_llama = model_conformance.make_suite("LlamaForCausalLM", transformers.LlamaConfig,
                                          rope_theta=500000.0, rope_scaling=LLAMA3_ROPE)
test_llama_linear_rope = model_conformance.make_suite(
    "LlamaForCausalLM", transformers.LlamaConfig, seeds=(2,), checks=("greedy",),
    rope_scaling={"rope_type": "linear", "factor": 2.0})
test_mistral = model_conformance.make_suite("MistralForCausalLM", transformers.MistralConfig, sliding_window=8)
test_qwen2 = model_conformance.make_suite("Qwen2ForCausalLM", transformers.Qwen2Config)
test_qwen3 = model_conformance.make_suite("Qwen3ForCausalLM", transformers.Qwen3Config)


# -- planted bugs: Llama variants, each wrong in one way, served under their own architecture name ----

def _llama(hf_config, ctx, cls=None):
    from backplane.models.llama import LlamaForCausalLM, build_model

    return build_model(cls or LlamaForCausalLM, hf_config, ctx)


def perturbed_logits(hf_config, ctx):
    """Logits off by 1e-3 noise: greedy tokens mostly survive, the logprobs do not."""
    model = _llama(hf_config, ctx)
    forward = model.forward

    def noisy(batch):
        out = forward(batch)
        out.logits.add_(1e-3 * torch.randn_like(out.logits))
        return out

    model.forward = noisy
    return model


def wrong_rope_base(hf_config, ctx):
    """Every layer's rotary with 4x the configured base."""
    model = _llama(hf_config, ctx)
    for layer in model.model.layers:
        old = layer.self_attn.rotary_emb
        rotary_dim, max_position, base, scaling = old.cache_args
        layer.self_attn.rotary_emb = RotaryEmbedding(old.head_dim, rotary_dim, max_position, base * 4, scaling, True, ctx)
    return model


def positions_from_zero(hf_config, ctx):
    """Each prefill batch numbers its new tokens from 0, as if nothing were cached before them:
    right for a whole prompt, wrong for a second chunk or after a cached prefix."""
    model = _llama(hf_config, ctx)
    forward = model.forward

    def renumbered(batch):
        if batch.forward_mode is ForwardMode.EXTEND:
            batch = copy.copy(batch)
            batch.positions = torch.cat([torch.arange(n) for n in batch.extend_seq_lens.tolist()])
        return forward(batch)

    model.forward = renumbered
    return model


PLANTED = {"PerturbedLogitsLlama": perturbed_logits, "WrongRopeBaseLlama": wrong_rope_base,
           "PositionsFromZeroLlama": positions_from_zero}


class PlantedBugs:
    @hookimpl
    def backplane_register_models(self, register):
        for architecture, factory in PLANTED.items():
            register(ModelSpec(architecture=architecture, factory=factory, description="a planted bug"))


@pytest.mark.parametrize("architecture, check, message", [
    ("PerturbedLogitsLlama", "greedy", "logprob"),
    ("WrongRopeBaseLlama", "greedy", "transformers"),
    ("PositionsFromZeroLlama", "chunked_prefill", "chunked prefill"),
    ("PositionsFromZeroLlama", "prefix_cache", "prefix cache"),
    ("PositionsFromZeroLlama", "preemption", "preemption"),
])
def test_the_suite_fails_on_a_planted_bug(architecture, check, message, tmp_path):
    reference = save_reference(architecture, transformers.LlamaConfig, 0, tmp_path)
    with pytest.raises(AssertionError, match=message):
        check_model(reference, check, 0, plugins=[PlantedBugs()])


def test_a_bug_only_chunks_show_passes_the_greedy_check(tmp_path):
    """Why the chunked-prefill and prefix-cache checks exist: whole-prompt greedy misses this bug."""
    reference = save_reference("PositionsFromZeroLlama", transformers.LlamaConfig, 0, tmp_path)
    check_model(reference, "greedy", 0, plugins=[PlantedBugs()])


def test_bad_check_names_are_refused(tmp_path):
    with pytest.raises(ValueError, match="checks: unknown warp; expected some of greedy, chunked_prefill"):
        model_conformance.make_suite("LlamaForCausalLM", transformers.LlamaConfig, checks=("greedy", "warp"))
    with pytest.raises(ValueError, match="check: expected one of greedy, .* got 'warp'"):
        check_model(None, "warp", 0)


def _docs_example(tmp_path):
    """The worked example of docs/plugins.md ("Writing a model plugin"), imported as a module."""
    import importlib.util
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "plugins.md").read_text()
    start = doc.index("```python\n# my_models/__init__.py") + len("```python\n")
    path = tmp_path / "my_models.py"
    path.write_text(doc[start: doc.index("```\n", start)])
    spec = importlib.util.spec_from_file_location("my_models", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, path


@pytest.mark.parametrize("seed, check", [(0, "greedy"), (1, "greedy"), (0, "chunked_prefill")])
def test_the_docs_example_model_plugin_passes_the_suite(seed, check, tmp_path):
    from backplane.testing.boundary import check_plugin_imports

    module, path = _docs_example(tmp_path)
    assert check_plugin_imports(path.parent, "my_models") == []
    reference = save_reference("MyForCausalLM", transformers.LlamaConfig, seed, tmp_path / "model",
                               {"rope_scaling": LLAMA3_ROPE})
    check_model(reference, check, seed, plugins=[module])
