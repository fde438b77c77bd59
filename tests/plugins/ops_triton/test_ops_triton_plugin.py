"""The ops_triton plugin as installed: its priorities on cuda and cpu, `--custom-ops op=triton`, the
compile-safe flag, `backplane plugins`, and tiny-llama greedy output with every triton op forced
(interpreter), eager and under torch.compile, and the fused rotary + K/V write behind the
attention backend's opt-in."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere: run kernels on CPU

import dataclasses  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from backplane import CustomOpImpl, Engine, SamplingParams  # noqa: E402
from backplane.ops.dispatch import CustomOps, resolve_custom_ops  # noqa: E402
from backplane.ops.names import OP_NAMES  # noqa: E402
from backplane.ops.native import NATIVE_OPS  # noqa: E402
from backplane.plugin.manager import load_plugins  # noqa: E402
from backplane.plugins.ops_triton import CUDA_PRIORITY  # noqa: E402
from backplane.plugins.ops_triton import ops as triton_ops  # noqa: E402

TRITON_OPS = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding", "rotary_kv_write", "greedy_sample",
              "moe_route")
NAMED_ONLY_ON_CUDA = ("greedy_sample",)  # the plugin's docstring says why
FORCED = [f"{op}=triton" for op in TRITON_OPS]
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [20]]


@pytest.fixture(scope="module")
def impls():
    registry = load_plugins(only=["ops_triton"]).registry
    return list(registry.specs("custom_op").values())


def test_registered_on_both_platforms_compile_safe(impls):
    mine = [impl for impl in impls if impl.name == "triton"]
    assert sorted((impl.op, impl.platform) for impl in mine) == sorted(
        (op, p) for op in TRITON_OPS for p in ("cpu", "cuda"))
    assert all(impl.compile_safe for impl in mine)
    assert {impl.op: impl.priority for impl in mine if impl.platform == "cuda"} == {
        op: -10 if op in NAMED_ONLY_ON_CUDA else CUDA_PRIORITY for op in TRITON_OPS}
    assert all(impl.priority < 0 for impl in mine if impl.platform == "cpu")


def test_cuda_picks_triton_by_priority(impls, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ops = resolve_custom_ops(impls, "cuda", {})
    # greedy_sample is named only on CUDA (the plugin's docstring)
    assert {op: ops.chosen[op] for op in TRITON_OPS} == {
        op: "native" if op in NAMED_ONLY_ON_CUDA else "triton" for op in TRITON_OPS}
    for op in NAMED_ONLY_ON_CUDA:
        assert resolve_custom_ops(impls, "cuda", {op: "triton"}).chosen[op] == "triton"
    # a plugin ranked below native runs only when named
    low = [dataclasses.replace(i, priority=-10) if i.name == "triton" else i for i in impls]
    assert resolve_custom_ops(low, "cuda", {}).chosen["rms_norm"] == "native"
    assert resolve_custom_ops(low, "cuda", {"rms_norm": "triton"}).chosen["rms_norm"] == "triton"
    assert ops.chosen["gelu"] == "native"
    assert ops.rms_norm is triton_ops.rms_norm and "rms_norm" in ops.compile_safe
    assert resolve_custom_ops(impls, "cuda", {"rms_norm": "native"}).chosen["rms_norm"] == "native"


def test_cuda_without_a_gpu_says_why_and_uses_native(impls, monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ranked = [dataclasses.replace(i, priority=50) if i.name == "triton" else i for i in impls]
    with caplog.at_level("WARNING", logger="backplane.ops.dispatch"):
        ops = resolve_custom_ops(ranked, "cuda", {})
    assert ops.chosen["rms_norm"] == "native"
    assert any("triton (priority 50) cannot run: CUDA is not available" in m for m in caplog.messages)


def test_cpu_picks_native_unless_asked(impls):
    ops = resolve_custom_ops(impls, "cpu", {})
    assert ops.chosen == {op: "native" for op in OP_NAMES}
    forced = resolve_custom_ops(impls, "cpu", {"rms_norm": "triton", "silu_and_mul": "triton"})
    assert forced.rms_norm is triton_ops.rms_norm and forced.chosen["silu_and_mul"] == "triton"
    assert forced.chosen["fused_add_rms_norm"] == "native"


def test_cpu_override_without_the_interpreter_is_an_error(impls, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match=r"'rms_norm=triton'.*cannot run here: .*TRITON_INTERPRET=1"):
        resolve_custom_ops(impls, "cpu", {"rms_norm": "triton"})


def test_for_compile_keeps_compile_safe_ops_only():
    def plain(x, weight, eps):
        return x

    impls = [CustomOpImpl("rms_norm", "cpu", plain, "plain", priority=5),
             CustomOpImpl("silu_and_mul", "cpu", triton_ops.silu_and_mul, "triton", priority=5, compile_safe=True)]
    ops = resolve_custom_ops(impls, "cpu", {})
    assert ops.rms_norm is plain and ops.compile_safe == frozenset(OP_NAMES) - {"rms_norm"}
    compiled = ops.for_compile()
    assert compiled.rms_norm is NATIVE_OPS["rms_norm"] and compiled.chosen["rms_norm"] == "native"
    assert compiled.silu_and_mul is triton_ops.silu_and_mul and compiled.chosen["silu_and_mul"] == "triton"
    assert CustomOps.native().for_compile() == CustomOps.native()


def test_backplane_plugins_lists_it():
    out = subprocess.run([sys.executable, "-m", "backplane.cli", "plugins", "--json"], capture_output=True,
                         text=True, check=True, env={**os.environ, "BACKPLANE_PLUGINS": "ops_triton"}).stdout
    listed = json.dumps(json.loads(out))
    assert "ops_triton" in listed and "rms_norm/cuda/triton" in listed and "rotary_kv_write/cpu/triton" in listed


@pytest.fixture(scope="module")
def model_dir():
    return "tiny-llama"  # the preset, dummy weights; head dim 64 (the triton attention backend takes it)


def _tokens(engine) -> list[list[int]]:
    params = [SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)] * len(PROMPTS)
    return [out.token_ids for out in engine.generate(input_ids=PROMPTS, sampling_params=params)]


ENGINE = dict(device="cpu", dtype="float32", attention_backend="torch_native", max_total_tokens=1024,
              max_running_requests=4)


@pytest.fixture(scope="module")
def native_tokens(model_dir):
    return _tokens(Engine(model_dir, **ENGINE))


def test_greedy_with_triton_ops_equals_native(model_dir, native_tokens):
    engine = Engine(model_dir, custom_ops=FORCED, **ENGINE)
    assert {op: engine.backends["custom_ops"][op] for op in TRITON_OPS} == {op: "triton" for op in TRITON_OPS}
    assert engine.scheduler.launcher.greedy_sample is triton_ops.greedy_sample  # the sampler's op too
    assert _tokens(engine) == native_tokens


def test_torch_compile_keeps_the_compile_safe_ops(model_dir, native_tokens, monkeypatch):
    """The compiled decode holds torch.ops.ops_triton.* as opaque calls (recorded from the graph
    Dynamo hands to Inductor), and those calls run the kernels."""
    from torch._inductor.compile_fx import compile_fx

    from backplane.executor import compiled as compiled_module

    seen, launches = set(), []
    real_compile, real_kernels = torch.compile, triton_ops._kernels

    def recording_backend(gm, example_inputs):
        seen.update(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return compile_fx(gm, example_inputs)

    def kernels_from_the_op():
        if not torch.compiler.is_compiling() and sys._getframe(1).f_code.co_name.endswith("_op"):
            launches.append(sys._getframe(1).f_code.co_name)
        return real_kernels()

    monkeypatch.setattr(compiled_module.torch, "compile", lambda model, **kw: real_compile(
        model, backend=recording_backend, **kw))
    monkeypatch.setattr(triton_ops, "_kernels", kernels_from_the_op)
    engine = Engine(model_dir, custom_ops=["rms_norm=triton", "fused_add_rms_norm=triton", "silu_and_mul=triton"],
                    enable_torch_compile=True, **ENGINE)
    assert engine.runner.compiled_eager is not None
    assert _tokens(engine) == native_tokens
    assert {"ops_triton.rms_norm.default", "ops_triton.fused_add_rms_norm.default",
            "ops_triton.silu_and_mul.default"} <= seen, sorted(seen)
    assert {"rms_norm_op", "fused_add_rms_norm_op", "silu_and_mul_op"} <= set(launches)


@pytest.mark.parametrize("rotary_kv_write", ["native", "triton"])
def test_triton_attention_takes_kv_written_by_rotary_kv_write(model_dir, monkeypatch, rotary_kv_write):
    """The triton attention backend opts in (fuses_rotary_kv_write): the layer rotates and writes K/V
    in one op, the backend does not write them again, and greedy output equals torch_native's."""
    from backplane.contracts.memory import TokenToKVPool
    from backplane.ops import native
    from backplane.plugins.ops_triton import kernels

    fused, pool_writes = [], []
    real_kernel, real_native, real_write = kernels.rotary_kv_write, native.rotary_kv_write, TokenToKVPool.set_kv_buffer
    monkeypatch.setattr(kernels, "rotary_kv_write", lambda *a: fused.append("triton") or real_kernel(*a))
    monkeypatch.setattr(TokenToKVPool, "set_kv_buffer", lambda *a: pool_writes.append(1) or real_write(*a))
    if rotary_kv_write == "native":  # the table holds the function itself: record through the layer
        from backplane.layers.rotary import RotaryEmbedding

        real_layer = RotaryEmbedding.forward_kv_write
        monkeypatch.setattr(RotaryEmbedding, "forward_kv_write", lambda *a: fused.append("native") or real_layer(*a))
    want = _tokens(Engine(model_dir, **ENGINE))
    assert not fused and pool_writes  # torch_native did not opt in: it wrote K/V itself
    pool_writes.clear()
    engine = Engine(model_dir, custom_ops=[f"rotary_kv_write={rotary_kv_write}"],
                    **{**ENGINE, "attention_backend": "triton"})
    assert engine.backends["custom_ops"]["rotary_kv_write"] == rotary_kv_write
    assert _tokens(engine) == want
    assert fused and set(fused) == {rotary_kv_write} and not pool_writes
    assert real_native is native.rotary_kv_write


def test_backend_that_does_not_opt_in_is_called_as_before(model_dir, native_tokens, monkeypatch):
    """torch_native keeps the default (fuses_rotary_kv_write False): it gets rotated q/k and no
    kv_written argument, and writes K/V itself."""
    from backplane.attention.torch_native import TorchNativeAttnBackend

    seen = []
    real = TorchNativeAttnBackend.forward_extend

    def forward_extend(self, q, k, v, layer, batch):  # the pre-opt-in signature
        seen.append(1)
        return real(self, q, k, v, layer, batch)

    monkeypatch.setattr(TorchNativeAttnBackend, "forward_extend", forward_extend)
    engine = Engine(model_dir, custom_ops=FORCED, **ENGINE)
    assert _tokens(engine) == native_tokens and seen
