"""Model conformance: a registered model architecture against its transformers class, through the engine.

In a model plugin's test suite:

    from backplane.testing import model_conformance
    test_mine = model_conformance.make_suite("MyForCausalLM", transformers.MyConfig, plugins=[my_plugin])

Each case draws a small random config (1 or 2 layers, hidden 64, 1, 2 or 4 KV heads, tied embeddings
or not), builds transformers' model for it (`AutoModelForCausalLM.from_config`) with random weights in
fp32 and saves it as a checkpoint, then serves that directory with `backplane.Engine`, on the CPU in
fp32 (torch_native attention) but for `graphs`. The checks:

- `greedy`: greedy tokens and each chosen token's log-probability equal transformers' (a token may
  differ only at a near tie: transformers' own logits for the two within `TIE_MARGIN`);
- `chunked_prefill`: prompts prefilled in chunks of `CHUNK` tokens give the same;
- `prefix_cache`: a second request that shares the first one's prefix reads it from the cache, and
  gives the same as transformers;
- `preemption`: a KV pool too small for the running requests preempts and recomputes, with the same tokens;
- `tensor_parallel`: the engine on 2 CPU ranks (`tp_size=2`, gloo) gives the same as transformers, each
  attention layer holding its share of the heads (KV heads replicated when fewer than ranks). Plugin
  modules reach the workers by name, other plugin objects pickled;
- `graphs` (CUDA only; the suite's cases carry the `gpu` marker): in bf16, the engine with CUDA graphs
  against the same engine with `disable_cuda_graph=True`, for each of GRAPH_BACKENDS: the same greedy
  tokens (a token may differ only where the fp32 reference nearly ties the two: within
  GRAPH_TIE_FRACTION of its logits' spread) and logprobs within GRAPH_LOGPROB_TOLERANCE. Its config is
  the case's with GRAPH_SHAPE on top (a head dim the GPU backends serve).

`tensor_parallel` and `graphs` test the engine's modes rather than the model's shape: make_suite runs
them for the first seed only (a tensor-parallel engine starts a worker process: ~0.5 s on the CPU).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from backplane.contracts import ForwardMode
from backplane.layers import Attention

CHECKS = ("greedy", "chunked_prefill", "prefix_cache", "preemption", "tensor_parallel", "graphs")
FIRST_SEED_ONLY = ("tensor_parallel", "graphs")  # make_suite runs these for its first seed alone
LOGPROB_TOLERANCE = 2e-4  # fp32, absolute
TIE_MARGIN = 1e-4  # fp32 logits this close are a near tie: either token is right
CHUNK = 8
STEPS = 10
ENGINE_ARGS = dict(device="cpu", dtype="float32", attention_backend="torch_native")
# 4 heads and intermediate 96 divide by TP_SIZE; the KV heads drawn (1, 2, 4) divide it or are replicated.
BASE_SHAPE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, head_dim=16, vocab_size=300,
                  max_position_embeddings=512, rms_norm_eps=1e-6)
TP_SIZE = 2
GRAPH_BACKENDS = ("triton", "flashinfer")
GRAPH_SHAPE = dict(hidden_size=256, head_dim=64)  # head dim 64: served by both GPU backends
GRAPH_ENGINE_ARGS = dict(device="cuda", dtype="bfloat16", cuda_graph_max_bs=8, max_running_requests=8,
                         max_total_tokens=4096)
GRAPH_LOGPROB_TOLERANCE = 0.05  # bf16, absolute: a few ulps of a logit of a few units
GRAPH_TIE_FRACTION = 0.1  # of the fp32 reference logits' standard deviation at the first difference


def random_shape(seed: int) -> dict[str, Any]:
    """The config keyword arguments of case `seed`: BASE_SHAPE with layers, KV heads and tying drawn."""
    rng = random.Random(seed)
    return {**BASE_SHAPE, "num_hidden_layers": rng.choice((1, 2)), "num_key_value_heads": rng.choice((1, 2, 4)),
            "tie_word_embeddings": rng.random() < 0.5}


@dataclass
class Reference:
    """A transformers model saved at `path`; `greedy(prompt)` gives its greedy continuation.

    recipe: save_reference's (architecture, config_factory, seed, overrides), so a check can save the
    same model in another shape (`reshaped`); None for a reference built by hand.
    """

    model: Any
    path: Path
    steps: int = STEPS
    recipe: tuple[str, Callable[..., Any], int, dict[str, Any]] | None = None
    _reshaped: dict[str, Reference] = field(default_factory=dict, init=False, repr=False, compare=False)

    def reshaped(self, tag: str, shape: dict[str, Any]) -> Reference:
        """The same recipe with `shape` over its config, saved once beside this one (`<path>-<tag>`)."""
        if tag not in self._reshaped:
            if self.recipe is None:
                raise ValueError(f"reference {self.path}: the {tag} check needs save_reference's recipe to save "
                                 f"it with {shape}; expected a Reference from save_reference")
            architecture, config_factory, seed, overrides = self.recipe
            path = self.path.with_name(f"{self.path.name}-{tag}")
            path.mkdir(exist_ok=True)
            self._reshaped[tag] = save_reference(architecture, config_factory, seed, path, {**overrides, **shape})
        return self._reshaped[tag]

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
    weights (norms 1 + noise, biases nonzero), save it at `path` with `architecture` in config.json.

    The model is `transformers.AutoModelForCausalLM.from_config(config)` (the class transformers maps
    the config's `model_type` to), eager attention, fp32; every parameter is 0.1 * randn (norm
    weights 1 + 0.1 * randn), drawn from torch.manual_seed(seed).
    """
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
    return Reference(model.eval(), path, recipe=(architecture, config_factory, seed, dict(overrides or {})))


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


def check_tensor_parallel(reference: Reference, plugins: Sequence[Any], seed: int) -> None:
    config = reference.model.config
    prompts = random_prompts(seed, (5, 17, 1, 23), config.vocab_size)
    engine = _engine(reference, plugins, tp_size=TP_SIZE, max_total_tokens=1024)
    try:
        heads = {(m.info.num_heads, m.info.num_kv_heads) for m in engine.runner.model.modules() if isinstance(m, Attention)}
        outs = _generate(engine, prompts, reference.steps)
    finally:
        engine.shutdown()
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    share = (config.num_attention_heads // TP_SIZE, max(1, kv_heads // TP_SIZE))
    assert heads == {share}, (f"tensor parallel {TP_SIZE}: rank 0's attention layers hold (query, KV) heads {sorted(heads)}, "
                              f"expected {share} of ({config.num_attention_heads}, {kv_heads}): the model is not split "
                              "over the ranks (backplane.layers' parallel linears and ctx.parallel)")
    for n, (prompt, out) in enumerate(zip(prompts, outs)):
        assert_matches(f"tensor parallel {TP_SIZE}, request {n}", prompt, out, reference)


def assert_same_greedy(what: str, prompt: Sequence[int], got: Any, want: Any, reference: Reference) -> None:
    """got against want (two RequestOutputs of one prompt, from two runs of the same model): equal tokens
    with logprobs within GRAPH_LOGPROB_TOLERANCE, until a token that differs where the fp32 reference
    nearly ties the two (within GRAPH_TIE_FRACTION of its logits' standard deviation)."""
    assert len(got.token_ids) == len(want.token_ids), f"{what}: {len(got.token_ids)} tokens, expected {len(want.token_ids)}"
    for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids)):
        if a != b:
            with torch.no_grad():
                row = reference.model(torch.tensor([list(prompt) + list(want.token_ids[:i])])).logits[0, -1].float()
            margin = float((row[a] - row[b]).abs() / row.std())
            assert margin <= GRAPH_TIE_FRACTION, (
                f"{what}: token {i} is {a}, expected {b} (fp32 reference margin {margin:.3g} of its logits' "
                f"standard deviation; a near tie is <= {GRAPH_TIE_FRACTION})")
            return  # after a near tie the two continuations part
        assert abs(got.logprobs[i] - want.logprobs[i]) <= GRAPH_LOGPROB_TOLERANCE, (
            f"{what}: token {i} logprob {got.logprobs[i]:.4f}, expected {want.logprobs[i]:.4f} "
            f"(tolerance {GRAPH_LOGPROB_TOLERANCE})")


def _graph_run(reference: Reference, plugins: Sequence[Any], backend: str, prompts: list[list[int]],
               steps: list[int], graphs: bool) -> tuple[list[Any], list[ForwardMode]]:
    """(outputs, the forward mode of every graph replay) of one bf16 CUDA engine, graphs on or off."""
    from backplane import SamplingParams

    engine = _engine(reference, plugins, attention_backend=backend, disable_cuda_graph=not graphs, **GRAPH_ENGINE_ARGS)
    replayed: list[ForwardMode] = []
    try:
        if graphs:
            assert engine.runner.graph_runner is not None, f"graphs ({backend}): the engine captured no CUDA graph"
            _count_calls(engine.runner.graph_runner, "replay", lambda batch, *_: replayed.append(batch.forward_mode))
        params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in steps]
        outs = engine.generate(input_ids=prompts, sampling_params=params)
    finally:
        engine.shutdown()
    for out in outs:
        assert out.error is None, f"graphs ({backend}): request failed: {out.error}"
    return outs, replayed


def _check_graph_replay(reference: Reference, plugins: Sequence[Any], seed: int, backend: str) -> None:
    # Different lengths: the decode batch shrinks from 6 requests to 1, replaying padded graphs of several sizes.
    prompts = random_prompts(seed, (5, 17, 1, 23, 40, 9), reference.model.config.vocab_size)
    steps = [STEPS + 2 * n for n in range(len(prompts))]
    eager, _ = _graph_run(reference, plugins, backend, prompts, steps, graphs=False)
    graphed, replayed = _graph_run(reference, plugins, backend, prompts, steps, graphs=True)
    assert ForwardMode.DECODE in replayed, f"graphs ({backend}): no decode step replayed a graph ({replayed})"
    for n, (prompt, got, want) in enumerate(zip(prompts, graphed, eager)):
        assert_same_greedy(f"graphs ({backend}, bf16) against eager, request {n}", prompt, got, want, reference)


def graph_backend_problem(backend: str, plugins: Sequence[Any] = ()) -> str | None:
    """None when attention backend `backend` is registered and available here, else why not."""
    from backplane.plugin.manager import load_plugins

    registered = load_plugins(extra=list(plugins)).registry.items["attention"].get(backend)
    if registered is None:
        return f"attention backend {backend!r} is not registered"
    return registered.item.available()


def check_graphs(reference: Reference, plugins: Sequence[Any], seed: int, attention_backend: str | None = None) -> None:
    """Graph replay against eager for `attention_backend` (default: each of GRAPH_BACKENDS); pytest.skip
    without CUDA, and for a backend that is not available (after checking the others)."""
    import pytest

    if not torch.cuda.is_available():
        pytest.skip("graphs: needs a CUDA device")
    reference = reference.reshaped("graphs", GRAPH_SHAPE)
    skipped = []
    for backend in [attention_backend] if attention_backend else GRAPH_BACKENDS:
        problem = graph_backend_problem(backend, plugins)
        if problem is None:
            _check_graph_replay(reference, plugins, seed, backend)
        else:
            skipped.append(f"{backend}: {problem}")
    if skipped:
        pytest.skip(f"graphs: skipped {'; '.join(skipped)}")


CHECK_FUNCTIONS = {"greedy": check_greedy, "chunked_prefill": check_chunked_prefill,
                   "prefix_cache": check_prefix_cache, "preemption": check_preemption,
                   "tensor_parallel": check_tensor_parallel, "graphs": check_graphs}


def check_model(reference: Reference, check: str, seed: int, plugins: Sequence[Any] = (),
                attention_backend: str | None = None) -> None:
    """Run one check (a name of CHECKS) of the model served from reference.path; AssertionError on a mismatch.

    reference: from save_reference (the graphs check saves it again in GRAPH_SHAPE). seed: draws the
    prompts. plugins: plugin objects to register besides the installed ones; under tensor parallelism
    they must reach the workers (a module importable by name there, or a picklable object).
    attention_backend: for `graphs` only, one backend to check instead of each of GRAPH_BACKENDS.
    """
    if check not in CHECK_FUNCTIONS:
        raise ValueError(f"check: expected one of {', '.join(CHECKS)}, got {check!r}")
    if check == "graphs":
        check_graphs(reference, plugins, seed, attention_backend)
        return
    if attention_backend is not None:
        raise ValueError(f"attention_backend: only the graphs check takes one, got {attention_backend!r} for {check!r}")
    CHECK_FUNCTIONS[check](reference, plugins, seed)


def suite_cases(seeds: Sequence[int], checks: Sequence[str]) -> list[Any]:
    """make_suite's pytest params (seed, check, attention backend): FIRST_SEED_ONLY checks for the first
    seed alone, `graphs` once per GRAPH_BACKENDS backend with the `gpu` marker."""
    import pytest

    cases = []
    for n, seed in enumerate(seeds):
        for check in checks:
            if n and check in FIRST_SEED_ONLY:
                continue
            if check == "graphs":
                cases += [pytest.param(seed, check, backend, marks=pytest.mark.gpu, id=f"seed{seed}-graphs-{backend}")
                          for backend in GRAPH_BACKENDS]
            else:
                cases.append(pytest.param(seed, check, None, id=f"seed{seed}-{check}"))
    return cases


def make_suite(architecture: str, config_factory: Callable[..., Any], plugins: Sequence[Any] = (),
               seeds: Sequence[int] = (0, 1), checks: Sequence[str] = CHECKS, **overrides: Any):
    """A pytest test function parametrized over (seed, check): see suite_cases.

    architecture: the name a ModelSpec registers (written into config.json). config_factory: the
    transformers config class, or a function taking its keyword arguments. plugins: plugin objects
    to register besides the installed ones (the model's own, when it is not installed; a module, so
    that tensor-parallel workers can import it). overrides: config keyword arguments for every case
    (a feature to switch on, say).
    """
    import pytest

    unknown = sorted(set(checks) - set(CHECKS))
    if unknown:
        raise ValueError(f"checks: unknown {', '.join(unknown)}; expected some of {', '.join(CHECKS)}")
    saved: dict[int, Reference] = {}

    @pytest.mark.parametrize("seed, check, attention_backend", suite_cases(seeds, checks))
    def test_model_conformance(seed, check, attention_backend, tmp_path_factory):
        if seed not in saved:
            path = tmp_path_factory.mktemp(f"{architecture}-seed{seed}")
            saved[seed] = save_reference(architecture, config_factory, seed, path, overrides)
        check_model(saved[seed], check, seed, plugins, attention_backend)

    return test_model_conformance
