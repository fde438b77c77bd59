"""Model conformance: a registered model architecture against its transformers class, through the engine.

In a model plugin's test suite:

    from backplane.testing import model_conformance
    test_mine = model_conformance.make_suite("MyForCausalLM", transformers.MyConfig, plugins=[my_plugin])

Each case draws a small random config (1 or 2 layers, hidden 64, 1, 2 or 4 KV heads, tied embeddings
or not), builds the transformers model with random weights in fp32 and saves it as a checkpoint,
then serves that directory with `backplane.Engine` on the CPU (torch_native attention). The checks:

- `greedy`: greedy tokens and each chosen token's log-probability equal transformers' (a token may
  differ only at a near tie: transformers' own logits for the two within `TIE_MARGIN`);
- `chunked_prefill`: prompts prefilled in chunks of `CHUNK` tokens give the same;
- `prefix_cache`: a second request that shares the first one's prefix reads it from the cache, and
  gives the same as transformers;
- `preemption`: a KV pool too small for the running requests preempts and recomputes, with the same tokens.

Not here yet: tensor parallelism and graph replay (the GPU suites).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from backplane.contracts import ForwardMode

CHECKS = ("greedy", "chunked_prefill", "prefix_cache", "preemption")
LOGPROB_TOLERANCE = 2e-4  # fp32, absolute
TIE_MARGIN = 1e-4  # fp32 logits this close are a near tie: either token is right
CHUNK = 8
STEPS = 10
ENGINE_ARGS = dict(device="cpu", dtype="float32", attention_backend="torch_native")
BASE_SHAPE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, head_dim=16, vocab_size=300,
                  max_position_embeddings=512, rms_norm_eps=1e-6)


def random_shape(seed: int) -> dict[str, Any]:
    """The config keyword arguments of case `seed`: BASE_SHAPE with layers, KV heads and tying drawn."""
    rng = random.Random(seed)
    return {**BASE_SHAPE, "num_hidden_layers": rng.choice((1, 2)), "num_key_value_heads": rng.choice((1, 2, 4)),
            "tie_word_embeddings": rng.random() < 0.5}


@dataclass
class Reference:
    """A transformers model saved at `path`, with its greedy continuations remembered per prompt."""

    model: Any
    path: Path
    steps: int = STEPS

    def greedy(self, prompt: Sequence[int]) -> tuple[list[int], torch.Tensor]:
        """(the `steps` greedy tokens, fp32 logits [steps, vocab]: row i the distribution of token i)."""
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(self.steps):
                ids.append(int(self.model(torch.tensor([ids])).logits[0, -1].argmax()))
            logits = self.model(torch.tensor([ids])).logits[0].float()
        return ids[len(prompt):], logits[len(prompt) - 1: -1]


def save_reference(architecture: str, config_factory: Callable[..., Any], seed: int, path: Path,
                   overrides: dict[str, Any] | None = None) -> Reference:
    """Build config_factory(**random_shape(seed), **overrides) as transformers' model with random
    weights (norms 1 + noise, biases nonzero), save it at `path` with `architecture` in config.json."""
    from transformers import AutoModelForCausalLM

    config = config_factory(**{**random_shape(seed), **(overrides or {})})
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale_one = name.endswith("norm.weight")
            param.copy_((1.0 if scale_one else 0.0) + 0.1 * torch.randn_like(param))
    model.save_pretrained(path)
    doc = json.loads((path / "config.json").read_text())
    doc["architectures"] = [architecture]  # NOTE: save_pretrained writes transformers' class name
    (path / "config.json").write_text(json.dumps(doc))
    return Reference(model.eval(), path)


def random_prompts(seed: int, lengths: Sequence[int], vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1000 + seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def assert_matches(what: str, prompt: Sequence[int], output: Any, reference: Reference) -> None:
    """output (a RequestOutput) against transformers' greedy continuation of `prompt`."""
    tokens, logits = reference.greedy(prompt)
    assert len(output.token_ids) == len(tokens), f"{what}: {len(output.token_ids)} tokens, expected {len(tokens)}"
    for i, (got, want) in enumerate(zip(output.token_ids, tokens)):
        row = logits[i]
        expected = float(row.log_softmax(-1)[got])
        assert abs(output.logprobs[i] - expected) <= LOGPROB_TOLERANCE, (
            f"{what}: token {i} logprob {output.logprobs[i]:.6f}, transformers {expected:.6f} "
            f"(tolerance {LOGPROB_TOLERANCE})")
        if got != want:
            margin = float(row[want] - row[got])
            assert margin < TIE_MARGIN, (f"{what}: token {i} is {got}, transformers {want} "
                                         f"(logit margin {margin:.3g}, not a near tie)")
            return  # after a near tie the two continuations part


def _engine(reference: Reference, plugins: Sequence[Any], **args: Any):
    from backplane import Engine

    return Engine(str(reference.path), plugins=list(plugins), **{**ENGINE_ARGS, **args})


def _generate(engine, prompts: list[list[int]], steps: int) -> list[Any]:
    from backplane import SamplingParams

    params = SamplingParams(max_new_tokens=steps, temperature=0.0, ignore_eos=True)
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    for out in outs:
        assert out.error is None, f"request failed: {out.error}"
    return outs


def _count_calls(obj: Any, method: str, record: Callable[..., Any]) -> None:
    """Wrap obj.method so that record(*args) sees every call before it runs."""
    inner = getattr(obj, method)

    def wrapped(*args, **kwargs):
        record(*args)
        return inner(*args, **kwargs)

    setattr(obj, method, wrapped)


def check_greedy(reference: Reference, plugins: Sequence[Any], seed: int) -> None:
    prompts = random_prompts(seed, (5, 17, 1, 23), reference.model.config.vocab_size)
    outs = _generate(_engine(reference, plugins), prompts, reference.steps)
    for n, (prompt, out) in enumerate(zip(prompts, outs)):
        assert_matches(f"greedy, request {n}", prompt, out, reference)


def check_chunked_prefill(reference: Reference, plugins: Sequence[Any], seed: int) -> None:
    prompts = random_prompts(seed, (3 * CHUNK + 5, CHUNK + 1, 4), reference.model.config.vocab_size)
    engine = _engine(reference, plugins, chunked_prefill_size=CHUNK, disable_radix_cache=True)
    extends: list[int] = []
    _count_calls(engine.runner, "forward", lambda batch: extends.append(batch.num_tokens)
                 if batch.forward_mode is ForwardMode.EXTEND else None)
    outs = _generate(engine, prompts, reference.steps)
    assert extends and max(extends) <= CHUNK, f"chunked prefill: prefill batches of {extends} tokens, expected <= {CHUNK}"
    for n, (prompt, out) in enumerate(zip(prompts, outs)):
        assert_matches(f"chunked prefill ({CHUNK} tokens), request {n}", prompt, out, reference)


def check_prefix_cache(reference: Reference, plugins: Sequence[Any], seed: int) -> None:
    first, tail = random_prompts(seed, (24, 7), reference.model.config.vocab_size)
    second = first[:16] + tail
    engine = _engine(reference, plugins)
    outs = _generate(engine, [first], reference.steps) + _generate(engine, [second], reference.steps)
    hits = engine.prefix_cache_stats["hit_tokens"]
    assert hits >= 16, f"prefix cache: {hits} tokens of the second request were cached, expected >= 16"
    assert_matches("prefix cache, first request", first, outs[0], reference)
    assert_matches("prefix cache, second request (16 tokens shared)", second, outs[1], reference)


def check_preemption(reference: Reference, plugins: Sequence[Any], seed: int) -> None:
    prompts = random_prompts(seed, (40, 30, 50, 20), reference.model.config.vocab_size)
    engine = _engine(reference, plugins, max_total_tokens=96, chunked_prefill_size=16, max_running_requests=3)
    preempted: list[Any] = []
    _count_calls(engine.scheduler.queues, "preempt", preempted.append)
    outs = _generate(engine, prompts, reference.steps)
    assert preempted, "preemption: no request was preempted; the case does not test it"
    for n, (prompt, out) in enumerate(zip(prompts, outs)):
        assert_matches(f"preemption ({len(preempted)} preempted), request {n}", prompt, out, reference)


CHECK_FUNCTIONS = {"greedy": check_greedy, "chunked_prefill": check_chunked_prefill,
                   "prefix_cache": check_prefix_cache, "preemption": check_preemption}


def check_model(reference: Reference, check: str, seed: int, plugins: Sequence[Any] = ()) -> None:
    """Run one check (a name of CHECKS) of the model served from reference.path; AssertionError on a mismatch."""
    if check not in CHECK_FUNCTIONS:
        raise ValueError(f"check: expected one of {', '.join(CHECKS)}, got {check!r}")
    CHECK_FUNCTIONS[check](reference, plugins, seed)


def make_suite(architecture: str, config_factory: Callable[..., Any], plugins: Sequence[Any] = (),
               seeds: Sequence[int] = (0, 1), checks: Sequence[str] = CHECKS, **overrides: Any):
    """A pytest test function parametrized over (seed, check).

    architecture: the name a ModelSpec registers (written into config.json). config_factory: the
    transformers config class, or a function taking its keyword arguments. plugins: plugin objects
    to register besides the installed ones (the model's own, when it is not installed). overrides:
    config keyword arguments for every case (a feature to switch on, say).
    """
    import pytest

    unknown = sorted(set(checks) - set(CHECKS))
    if unknown:
        raise ValueError(f"checks: unknown {', '.join(unknown)}; expected some of {', '.join(CHECKS)}")
    saved: dict[int, Reference] = {}

    @pytest.mark.parametrize("seed, check", [(s, c) for s in seeds for c in checks],
                             ids=[f"seed{s}-{c}" for s in seeds for c in checks])
    def test_model_conformance(seed, check, tmp_path_factory):
        if seed not in saved:
            path = tmp_path_factory.mktemp(f"{architecture}-seed{seed}")
            saved[seed] = save_reference(architecture, config_factory, seed, path, overrides)
        check_model(saved[seed], check, seed, plugins)

    return test_model_conformance
