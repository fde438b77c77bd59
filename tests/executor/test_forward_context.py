"""No per-forward state outside the ForwardContext: after every forward of a real engine (eager,
compiled, with LoRA, and one that raised) nothing is left bound — not on the model's context, the
LoRA layers, the op table, the opaque ops' module, nor written into the batch by a collaborator.
The check itself is shown to fail on planted violations."""

from __future__ import annotations

import pytest
import torch

from backplane import Engine, SamplingParams
from backplane.contracts.forward_context import ForwardSlot
from backplane.ops import opaque
from lora_helpers import make_lora_world

GREEDY = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 33, 2], [9, 8, 7]]
# The opaque ops' module keeps a registry of live layers (handles), nothing per forward.
OPAQUE_STATE = {"_LAYERS", "_HANDLES"}


def leftovers(engine: Engine, defaults: tuple) -> list[str]:
    """What is still bound after a forward, one line each (empty: nothing)."""
    runner, found = engine.runner, []
    ctx = runner.model_ctx
    if ctx.forward is not None:
        found.append(f"the model's ForwardContext is still bound: {ctx.forward}")
    if (ctx.default_attn_backend, ctx.default_ops) != defaults:
        found.append("the model's default backend or op table was swapped")
    manager = engine.lora_manager
    if manager is not None and manager.runtime.batch_info is not None:
        found.append("the LoRA layers still see a batch")
    mutable = {name for name, value in vars(opaque).items()
               if not name.startswith("__") and isinstance(value, (list, dict, set)) or name.startswith("_B")}
    found += [f"opaque module state {name!r}" for name in sorted(mutable - OPAQUE_STATE)]
    return found


def batch_fields(batch) -> dict:
    """The batch's attributes by identity (a collaborator writing into the batch changes one)."""
    return {name: (id(value), value if isinstance(value, (int, bool, str)) else None)
            for name, value in vars(batch).items() if name != "plugin_inputs"} | {
        "plugin_inputs": tuple(sorted(batch.plugin_inputs))}


@pytest.fixture()
def watched(monkeypatch):
    """Wrap ModelRunner.forward: after each call, record leftovers and whether the batch changed."""
    from backplane.executor.model_runner import ModelRunner

    reports: list[tuple[str, list[str], bool]] = []
    real = ModelRunner._dispatch

    def dispatch(self, batch, capture_hidden, use_graph):
        engine = self.watched_engine
        before, kind = batch_fields(batch), "ok"
        defaults = (self.model_ctx.default_attn_backend, self.model_ctx.default_ops)
        try:
            return real(self, batch, capture_hidden, use_graph)
        except Exception:
            kind = "raised"
            raise
        finally:
            reports.append((kind, leftovers(engine, defaults), batch_fields(batch) != before))

    monkeypatch.setattr(ModelRunner, "_dispatch", dispatch)
    return reports


def watch(engine: Engine) -> Engine:
    engine.runner.watched_engine = engine
    return engine


def assert_clean(reports) -> None:
    assert reports, "no forward ran"
    dirty = [(kind, found, changed) for kind, found, changed in reports if found or changed]
    assert not dirty, dirty


def test_eager_forwards_leave_nothing_bound(watched):
    engine = watch(Engine("tiny-llama", device="cpu", max_total_tokens=512))
    assert all(o.error is None for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY))
    assert_clean(watched)


def test_compiled_forwards_leave_nothing_bound(watched):
    engine = watch(Engine("tiny-llama", device="cpu", dtype="float32", attention_backend="torch_native",
                          max_total_tokens=512, enable_torch_compile=True))
    assert engine.runner.compiled_eager is not None
    assert all(o.error is None for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY))
    assert_clean(watched)


def test_lora_forwards_leave_nothing_bound(tmp_path, watched):
    world = make_lora_world(tmp_path)
    engine = watch(Engine(str(world.base_dir), device="cpu", dtype="float32", max_total_tokens=512,
                          lora_paths=world.lora_paths(), lora_backend="torch_native"))
    outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, lora=["all7_r4", None])
    assert all(o.error is None for o in outs)
    assert_clean(watched)


def test_a_forward_that_raised_leaves_nothing_bound(watched, monkeypatch):
    engine = watch(Engine("tiny-llama", device="cpu", max_total_tokens=512))
    backend = engine.runner.attn_backend
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("attention kernel failed")

    monkeypatch.setattr(backend, "forward", failing)
    outs = engine.generate(input_ids=PROMPTS[:1], sampling_params=GREEDY)
    assert calls and outs[0].error is not None
    assert any(kind == "raised" for kind, _, _ in watched)
    assert_clean(watched)
    monkeypatch.undo()
    assert engine.generate(input_ids=PROMPTS[:1], sampling_params=GREEDY)[0].error is None  # still serves


def test_the_check_sees_planted_violations(watched, monkeypatch):
    """A contributor that writes into the batch, and a slot that forgets to unbind, are both seen."""
    engine = watch(Engine("tiny-llama", device="cpu", max_total_tokens=512))

    class Sneaky:
        def begin_forward(self, batch):
            batch.sneaky = True  # per-forward state written into the inputs
            return {}

    engine.runner.contributors.append(Sneaky())
    engine.generate(input_ids=PROMPTS[:1], sampling_params=GREEDY)
    assert any(changed for _, _, changed in watched)
    engine.runner.contributors.pop()
    watched.clear()

    def sticky_enter(self, context):  # a slot that binds and never unbinds
        self._current = context
        return _Null()

    monkeypatch.setattr(ForwardSlot, "enter", sticky_enter)
    engine.generate(input_ids=PROMPTS[:1], sampling_params=GREEDY)
    assert any("still bound" in line for _, found, _ in watched for line in found)


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_torch_compile_does_not_recompile_per_forward():
    """A fresh ForwardContext per forward must not defeat Dynamo's guards: after warm-up, more
    decode steps of the same shapes compile nothing new."""
    engine = Engine("tiny-llama", device="cpu", dtype="float32", attention_backend="torch_native",
                    max_total_tokens=512, enable_torch_compile=True, max_running_requests=2)
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    engine.generate(input_ids=[[5, 6, 7]], sampling_params=params)
    stats = torch._dynamo.utils.counters["stats"]
    compiled_before, calls_before = stats["unique_graphs"], stats["calls_captured"]
    engine.generate(input_ids=[[8, 9, 10]], sampling_params=SamplingParams(max_new_tokens=8, temperature=0.0,
                                                                          ignore_eos=True))
    assert stats["unique_graphs"] == compiled_before, "a decode step of a seen shape compiled again"
    assert stats["calls_captured"] == calls_before
