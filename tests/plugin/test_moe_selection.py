"""--moe-backend: selection of a MoE backend for a MoE model (every declared limit refused in one line
with its fix, `auto` never falling back to a backend that cannot run), and the model runner's
wiring: the backend is the model's before it is built, told of every MoE layer after."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from helpers_plugins import make_plugin

from backplane import MoeBackendSpec
from backplane.contracts import MoeBackend, MoeBackendContext, MoeLayerInfo
from backplane.plugin.manager import load_plugins
from backplane.plugin.registry import RegistrationError, Registry
from backplane.plugin.runtime import PluginRuntimeError
from backplane.plugin.selection import MoeRequirements, SelectionError, select_moe_backend

CPU = MoeRequirements(platform="cpu", dtype="float32", num_experts=8, top_k=2)
GPU_GRAPHS = MoeRequirements(platform="cuda", dtype="bfloat16", num_experts=128, top_k=8, graphs=True)


@pytest.fixture(autouse=True)
def _only_builtins(monkeypatch):
    monkeypatch.setenv("BACKPLANE_PLUGINS", "")


def _registry(*specs: MoeBackendSpec, plugin: str = "toy_moe_plugin") -> Registry:
    def register_all(register):
        for spec in specs:
            register(spec)

    return load_plugins(extra=[make_plugin(plugin, backplane_register_moe_backends=register_all)]).registry


def _spec(name: str = "toy", **fields) -> MoeBackendSpec:
    return MoeBackendSpec(name=name, factory=lambda ctx: None, description="toy", **fields)


def _refusal(registry: Registry, name: str, req: MoeRequirements) -> str:
    with pytest.raises(SelectionError) as err:
        select_moe_backend(registry, name, req)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_the_core_registers_torch_native_without_graphs():
    registry = load_plugins().registry
    spec = registry.specs("moe")["torch_native"]
    assert registry.provenance("moe", "torch_native").plugin == "moe.builtin"
    assert spec.supports_graph is False and spec.quant_methods == ("fp8",) and spec.priority == 0
    choice = select_moe_backend(registry, "auto", CPU)
    assert choice.spec is spec and "chosen by --moe-backend auto" in choice.reason
    backend = spec.factory(MoeBackendContext(dtype=torch.float32, device=torch.device("cpu"), max_num_tokens=16))
    assert isinstance(backend, MoeBackend)


def test_defaults_claim_nothing_that_could_give_wrong_output():
    bare = _spec()
    assert (bare.supports_graph, bare.supports_compile, bare.quant_methods) == (False, False, ())
    assert (bare.max_top_k, bare.max_experts) == (None, None)


@pytest.mark.parametrize(("fields", "req", "words"), [
    (dict(platforms=("cuda",)), CPU, ["platform 'cpu' not supported"]),
    (dict(dtypes=("bfloat16",)), CPU, ["dtype float32 not supported"]),
    (dict(max_top_k=1), CPU, ["top-k 2 above its maximum 1"]),
    (dict(max_experts=4), CPU, ["8 experts above its maximum 4"]),
    (dict(), dataclasses.replace(CPU, graphs=True), ["CUDA graphs not supported", "--disable-cuda-graph", "moe_triton"]),
    (dict(supports_graph=True), dataclasses.replace(CPU, compile=True),
     ["torch.compile not supported", "drop --enable-torch-compile"]),
    (dict(), dataclasses.replace(CPU, quant="fp8"), ["quantized by 'fp8' not supported", "unquantized only"]),
    (dict(quant_methods=("int4",)), dataclasses.replace(CPU, quant="fp8"), ["supports: int4"]),
    (dict(available=lambda: "the kernels are not installed", install_hint="pip install toy-moe"), CPU,
     ["the kernels are not installed", "To fix: pip install toy-moe"]),
])
def test_an_explicit_backend_that_cannot_serve_is_refused_with_the_reason(fields, req, words):
    message = _refusal(_registry(_spec(**fields)), "toy", req)
    assert message.startswith("--moe-backend toy (plugin 'toy_moe_plugin') cannot run here: ")
    for word in words:
        assert word in message, message


@pytest.mark.parametrize(("fields", "req"), [
    (dict(max_top_k=2, max_experts=8), CPU),
    (dict(quant_methods=("fp8",)), dataclasses.replace(CPU, quant="fp8")),
    (dict(supports_graph=True, supports_compile=True, platforms=("cuda",)),
     dataclasses.replace(GPU_GRAPHS, compile=True)),
])
def test_a_backend_within_its_declared_limits_is_chosen(fields, req):
    spec = _spec(**fields)
    assert select_moe_backend(_registry(spec), "toy", req).spec is spec


def test_auto_takes_the_highest_priority_usable_backend():
    high_but_limited = _spec("limited", max_top_k=1, priority=100)
    usable = _spec("usable", priority=50)
    choice = select_moe_backend(_registry(high_but_limited, usable), "auto", CPU)
    assert choice.spec is usable
    assert "skipped limited (plugin 'toy_moe_plugin'): top-k 2 above its maximum 1" in choice.reason
    assert [alt.item.name for alt in choice.alternatives] == ["torch_native"]  # build_first's next in line


def test_auto_under_cuda_graphs_takes_a_graph_capable_backend_over_torch_native():
    graphs = _spec("graphs", supports_graph=True, priority=-5)  # below torch_native, but torch_native cannot capture
    assert select_moe_backend(_registry(graphs), "auto", GPU_GRAPHS).spec is graphs


def test_auto_under_cuda_graphs_without_a_graph_capable_backend_is_refused_naming_the_fix():
    message = _refusal(load_plugins().registry, "auto", GPU_GRAPHS)
    assert message.startswith("--moe-backend auto: no registered backend can run a MoE model (128 experts, top-k 8) "
                              "on platform 'cuda' with dtype bfloat16, under CUDA graphs; torch_native")
    assert "--disable-cuda-graph" in message and "moe_triton" in message


def test_unknown_name_lists_every_registered_backend():
    message = _refusal(_registry(_spec()), "nope", CPU)
    assert message.startswith("--moe-backend: unknown backend 'nope'; registered: torch_native (plugin 'moe.builtin'), "
                              "toy (plugin 'toy_moe_plugin'), or 'auto'. Not loaded, filtered out by BACKPLANE_PLUGINS")


def test_a_name_two_plugins_registered_is_pinned_with_name_at_plugin():
    twin = _spec("torch_native", priority=5)
    registry = _registry(twin, plugin="twin_plugin")
    message = _refusal(registry, "torch_native", CPU)
    assert "torch_native@moe.builtin or torch_native@twin_plugin" in message
    assert select_moe_backend(registry, "torch_native@twin_plugin", CPU).spec is twin


@pytest.mark.parametrize(("field", "bad"), [("max_top_k", 0), ("max_experts", "many"), ("quant_methods", "fp8"),
                                            ("supports_graph", "yes")])
def test_a_bad_field_is_refused_at_registration(field, bad):
    with pytest.raises(RegistrationError, match=f"plugin 'p', MoE backend 'toy': field {field} = "):
        Registry().callback("moe", "p", None)(dataclasses.replace(_spec(), **{field: bad}))


# -- the model runner ------------------------------------------------------------------------------


def test_moe_shape_reads_mixtral_and_qwen_configs_and_refuses_a_bad_top_k():
    from types import SimpleNamespace

    from backplane.executor.moe_setup import MoeShape, moe_shape

    assert moe_shape(SimpleNamespace(num_local_experts=8, num_experts_per_tok=2)) == MoeShape(8, 2)
    assert moe_shape(SimpleNamespace(num_experts=60, num_experts_per_tok=4)) == MoeShape(60, 4)
    assert moe_shape(SimpleNamespace(hidden_size=64)) is None and moe_shape(SimpleNamespace(num_experts=0)) is None
    with pytest.raises(ValueError, match=r"num_experts_per_tok = 9: expected an integer from 1 to the model's 8"):
        moe_shape(SimpleNamespace(num_local_experts=8, num_experts_per_tok=9))


def test_max_moe_tokens_covers_a_prefill_chunk_and_every_row_verifying():
    from types import SimpleNamespace

    from backplane.config import PoolConfig
    from backplane.executor.moe_setup import max_moe_tokens

    plain = SimpleNamespace(chunked_prefill_size=256, speculative_algorithm=None, speculative_num_draft_tokens=4)
    assert max_moe_tokens(plain, PoolConfig(req_rows=64, spec_room=0)) == 256
    verify = SimpleNamespace(**{**vars(plain), "speculative_algorithm": "ngram"})
    assert max_moe_tokens(verify, PoolConfig(req_rows=99, spec_room=4)) == 400  # (99 + 1 padding row) * 4


class RecordingBackend(MoeBackend):
    def __init__(self, ctx, log):
        self.ctx, self.log = ctx, log

    def register_layer(self, layer, info):
        self.log.append(("register", layer.name, info is layer.moe_info))

    def process_weights_after_loading(self, layer):
        self.log.append(("process", layer.name))

    def apply(self, layer, x, topk_weights, topk_ids):
        return torch.zeros_like(x)


class ToyMoeLayer(torch.nn.Module):
    """Stands in for FusedMoE: a `moe_info`, and the backend it found on the context when built."""

    def __init__(self, name, ctx):
        super().__init__()
        self.name, self.ctx, self.backend_at_build = name, ctx, ctx.moe_backend
        self.moe_info = MoeLayerInfo(layer_id=0, num_experts=4, top_k=2, hidden_size=8, intermediate_size=4,
                                     intermediate_size_per_partition=4, renormalize=True, params_dtype=torch.float32,
                                     device=torch.device("cpu"))

    def process_weights_after_loading(self):
        self.ctx.moe_backend.process_weights_after_loading(self)


def _toy_moe_model(hf_config, ctx):
    from backplane.models import llama

    model = llama.build_model(llama.LlamaForCausalLM, hf_config, ctx)
    model.toy_experts = torch.nn.ModuleList([ToyMoeLayer("a", ctx), ToyMoeLayer("b", ctx)])
    return model


def _runner(argv: dict, log: list, factory=None, **config):
    from backplane.executor.model_runner import ModelRunner
    from backplane.executor.resources import ModelSource
    from backplane.models.presets import get_preset
    from backplane.plugin.registry import ModelSpec
    from backplane.settings import build_server_args

    spec = MoeBackendSpec(name="recording", factory=factory or (lambda ctx: RecordingBackend(ctx, log)),
                          description="records its calls", priority=100)
    plugin = make_plugin("recording_moe",
                         backplane_register_moe_backends=lambda register: register(spec),
                         backplane_register_models=lambda register: register(
                             ModelSpec(architecture="ToyMoeForCausalLM", factory=_toy_moe_model)))
    plugin_set = load_plugins(extra=[plugin])
    hf_config = get_preset("tiny-llama")
    for key, value in config.items():
        setattr(hf_config, key, value)
    args = build_server_args(dict(model="tiny-llama", device="cpu", max_total_tokens=128, max_running_requests=4,
                                  chunked_prefill_size=64, **argv), plugin_set.settings_groups(), {})
    return ModelRunner(args, plugin_set, source=ModelSource(hf_config, "dummy", None))


MOE_CONFIG = dict(architectures=["ToyMoeForCausalLM"], num_local_experts=4, num_experts_per_tok=2)


def test_the_runner_sets_the_backend_before_building_and_registers_every_moe_layer():
    log: list = []
    runner = _runner({}, log, **MOE_CONFIG)
    backend = runner.model_ctx.moe_backend
    assert isinstance(backend, RecordingBackend)
    assert [layer.backend_at_build for layer in runner.model.toy_experts] == [backend, backend]
    assert log == [("register", "a", True), ("register", "b", True), ("process", "a"), ("process", "b")]
    assert backend.ctx.max_num_tokens == 64 and backend.ctx.quant is None  # max(64, (4 + 1) * 1)
    assert runner.backends_summary()["moe"]["backend"] == "recording"


def test_under_auto_a_factory_that_fails_gives_way_to_torch_native(caplog):
    def broken(ctx):
        raise RuntimeError("kernels missing")

    with caplog.at_level(logging.WARNING):
        runner = _runner({}, [], factory=broken, **MOE_CONFIG)
    assert runner.backends_summary()["moe"]["backend"] == "torch_native"
    assert "kernels missing" in caplog.text
    with pytest.raises(PluginRuntimeError, match="MoE backend 'recording': factory raised RuntimeError: kernels missing"):
        _runner({"moe_backend": "recording"}, [], factory=broken, **MOE_CONFIG)


def test_a_dense_model_builds_no_moe_backend_and_ignores_a_known_name(caplog):
    with caplog.at_level(logging.INFO, logger="backplane.executor.moe_setup"):
        runner = _runner({"moe_backend": "torch_native"}, [])
    assert "moe" not in runner.backends_summary()
    assert "--moe-backend torch_native: unused, the model has no experts" in caplog.text
    with pytest.raises(SelectionError, match=r"^--moe-backend: unknown backend 'nope'; registered: recording .*torch_native"):
        _runner({"moe_backend": "nope"}, [])


def test_a_model_context_nobody_configured_uses_torch_native_built_once():
    from backplane.models.base import ModelContext
    from backplane.moe.torch_native import TorchNativeMoeBackend

    ctx = ModelContext()
    assert isinstance(ctx.moe_backend, TorchNativeMoeBackend) and ctx.moe_backend is ctx.moe_backend
    mine = RecordingBackend(None, [])
    ctx.moe_backend = mine
    assert ctx.moe_backend is mine
