"""One test per hook (named after it), each through a throwaway plugin, plus the two meta-tests."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
from helpers_plugins import make_plugin
from pydantic import BaseModel

from backplane.plugin import hookspecs
from backplane.cli import parse_server_args
from backplane.plugin.manager import load_plugins
from backplane.plugin.registry import (
    AttentionBackendSpec,
    CustomOpImpl,
    LoraBackendSpec,
    ModelSpec,
    MoeBackendSpec,
    QuantMethodSpec,
    SpecAlgorithmSpec,
)
from backplane.plugin.selection import (AttentionRequirements, SelectionError, LoraRequirements, MoeRequirements,
                                        QuantRequirements, select_attention_backend, select_lora_backend,
                                        select_moe_backend, select_quant_method)

ROOT = Path(__file__).resolve().parents[2]
HOOK_NAMES = sorted(n for n in dir(hookspecs) if n.startswith("backplane_"))


@pytest.fixture(autouse=True)
def _only_builtins(monkeypatch):
    monkeypatch.setenv("BACKPLANE_PLUGINS", "")


def test_backplane_register_attention_backends():
    spec = AttentionBackendSpec(name="toy", factory=object, description="toy backend", priority=1000)
    plugin = make_plugin("toy_plugin", backplane_register_attention_backends=lambda register: register(spec))
    registry = load_plugins(extra=[plugin]).registry
    assert registry.provenance("attention", "toy").plugin == "toy_plugin"
    req = AttentionRequirements(platform="cpu", dtype="float32", head_dim=64, modes=("decode",))
    assert select_attention_backend(registry, "auto", req).spec is spec


def test_backplane_register_lora_backends():
    spec = LoraBackendSpec(name="toy_lora", factory=object, description="toy", priority=1000)
    plugin = make_plugin("toy_lora_plugin", backplane_register_lora_backends=lambda register: register(spec))
    registry = load_plugins(extra=[plugin]).registry
    req = LoraRequirements(platform="cpu", dtype="float32", max_rank=8)
    assert select_lora_backend(registry, "toy_lora", req).spec is spec


def test_backplane_register_quant_methods():
    spec = QuantMethodSpec(name="toy_quant", factory=object, description="toy", checkpoint_formats=("toy-format",),
                           priority=1000)
    plugin = make_plugin("toy_quant_plugin", backplane_register_quant_methods=lambda register: register(spec))
    registry = load_plugins(extra=[plugin]).registry
    req = QuantRequirements(platform="cpu", dtype="float32", checkpoint_format="toy-format")
    assert select_quant_method(registry, "auto", req).spec is spec  # auto follows the checkpoint's quant_method
    assert select_quant_method(registry, "toy_quant", req).spec is spec
    assert select_quant_method(registry, "auto", QuantRequirements("cpu", "float32", None)) is None
    # A method that does not declare LoRA is refused for a run with adapters, in one line naming why.
    with pytest.raises(SelectionError) as err:
        select_quant_method(registry, "toy_quant", QuantRequirements("cpu", "float32", "toy-format", lora=True))
    assert "\n" not in str(err.value) and "lora" in str(err.value).lower()


def test_backplane_register_moe_backends():
    spec = MoeBackendSpec(name="toy_moe", factory=object, description="toy", supports_graph=True, priority=1000)
    plugin = make_plugin("toy_moe_plugin", backplane_register_moe_backends=lambda register: register(spec))
    registry = load_plugins(extra=[plugin]).registry
    assert registry.provenance("moe", "toy_moe").plugin == "toy_moe_plugin"
    req = MoeRequirements(platform="cpu", dtype="float32", num_experts=8, top_k=2)
    assert select_moe_backend(registry, "auto", req).spec is spec
    # Under CUDA graphs the core's torch_native (no graphs) is refused in one line naming the fix.
    with pytest.raises(SelectionError) as err:
        select_moe_backend(registry, "torch_native", MoeRequirements("cuda", "bfloat16", 8, 2, graphs=True))
    assert "\n" not in str(err.value) and "--disable-cuda-graph" in str(err.value)


def test_backplane_register_custom_ops():
    from backplane.ops.dispatch import resolve_custom_ops

    def my_rms_norm(x, weight, eps):
        return x * 0 + 42.0

    impl = CustomOpImpl(op="rms_norm", platform="cpu", fn=my_rms_norm, name="toy", priority=10)
    plugin = make_plugin("toy_ops", backplane_register_custom_ops=lambda register: register(impl))
    registry = load_plugins(extra=[plugin]).registry
    impls = list(registry.specs("custom_op").values())
    ops = resolve_custom_ops(impls, "cpu", {})
    assert ops.rms_norm is my_rms_norm and ops.chosen["rms_norm"] == "toy"
    assert resolve_custom_ops(impls, "cpu", {"rms_norm": "native"}).rms_norm is not my_rms_norm


def test_backplane_register_spec_algorithms():
    spec = SpecAlgorithmSpec(name="toy_spec", factory=object, description="toy")
    plugin = make_plugin("toy_spec_plugin", backplane_register_spec_algorithms=lambda register: register(spec))
    registry = load_plugins(extra=[plugin]).registry
    assert registry.specs("spec")["toy_spec"] is spec


def test_backplane_register_models():
    spec = ModelSpec(architecture="ToyForCausalLM", factory=object, description="toy")
    plugin = make_plugin("toy_model_plugin", backplane_register_models=lambda register: register(spec))
    registry = load_plugins(extra=[plugin]).registry
    assert registry.specs("model")["ToyForCausalLM"] is spec
    assert "LlamaForCausalLM" in registry.specs("model")


class ToyOptions(BaseModel):
    level: int = 1


def test_backplane_register_settings():
    plugin = make_plugin("toy_settings", backplane_register_settings=lambda register: register("toy", ToyOptions))
    plugin_set = load_plugins(extra=[plugin])
    assert parse_server_args(["--toy.level", "3"], plugin_set).options_for("toy").level == 3
    assert parse_server_args([], plugin_set).options_for("toy").level == 1


def test_backplane_configure():
    seen = []

    def configure(settings):
        seen.append(settings.seed)
        if settings.seed == 13:
            raise ValueError("--seed 13: the toy plugin refuses unlucky seeds")

    plugin_set = load_plugins(extra=[make_plugin("toy_configure", backplane_configure=configure)])
    plugin_set.configure(parse_server_args(["--seed", "4"], plugin_set))
    assert seen == [4]
    with pytest.raises(ValueError, match="unlucky"):
        plugin_set.configure(parse_server_args(["--seed", "13"], plugin_set))


def test_every_hook_has_a_test_named_after_it():
    tests = {name for name, _ in inspect.getmembers(__import__(__name__), inspect.isfunction)}
    assert HOOK_NAMES and all(f"test_{hook}" in tests for hook in HOOK_NAMES)


def _signature_text(hook_name: str) -> str:
    source = inspect.getsource(getattr(hookspecs, hook_name))
    header = source[source.index("def "):source.index(":\n")]
    return re.sub(r"\s+", " ", header).replace("( ", "(").replace(", )", ")")


def test_every_hook_is_documented_with_its_exact_signature():
    docs = (ROOT / "docs" / "plugins.md").read_text()
    for hook in HOOK_NAMES:
        assert _signature_text(hook) in docs, f"docs/plugins.md lacks `{_signature_text(hook)}`"
