"""Every field of every spec kind is type- and value-checked at registration (issue 42, bug 7):
a wrong value is refused at once, in one line naming the plugin and the field."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backplane import AttentionBackendSpec, CustomOpImpl, LoraBackendSpec, ModelSpec, MoeBackendSpec, SpecAlgorithmSpec
from backplane.plugin.registry import KINDS, RegistrationError, Registry
from backplane.plugin.validation import FIELD_RULES


def _factory(*args):
    return None


VALID = {
    "attention": AttentionBackendSpec(name="ok", factory=_factory, description="t"),
    "lora": LoraBackendSpec(name="ok", factory=_factory, description="t"),
    "custom_op": CustomOpImpl(op="rms_norm", platform="cpu", fn=_factory, name="ok"),
    "spec": SpecAlgorithmSpec(name="ok", factory=_factory, description="t"),
    "model": ModelSpec(architecture="OkForCausalLM", factory=_factory),
    "moe": MoeBackendSpec(name="ok", factory=_factory, description="t"),
}
FIELDS = sorted((kind, f.name) for kind, spec in VALID.items() for f in dataclasses.fields(spec) if f.name != "op")

# Values of every JSON-ish type and a few Python ones; for each field most of them are wrong.
ANY_VALUE = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 5), st.floats(allow_nan=True), st.text(max_size=6),
    st.sampled_from(["cpu", "cuda", "tpu", "high", "float32", "decode", "prefill", ""]),
    st.lists(st.sampled_from(["cpu", "cuda", "tpu", "float16", "float8", "decode", "prefill", 64, 0, -1]), max_size=3),
    st.tuples(st.sampled_from(["cpu", "decode", "float32", 64]), st.sampled_from(["cpu", "extend", "bfloat16", 128])),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
)


def test_every_spec_field_has_a_rule():
    assert {name for _, name in FIELDS} <= set(FIELD_RULES)


@pytest.mark.parametrize(("kind", "field_name", "bad"), [
    ("attention", "priority", "high"),
    ("attention", "platforms", "cpu"),
    ("lora", "dtypes", "float16"),
    ("attention", "head_dims", (64, 0)),
    ("attention", "custom_mask", "yes"),
    ("lora", "max_rank", 0),
    ("moe", "max_top_k", 0),
    ("moe", "quant_methods", "fp8"),
    ("spec", "needs_draft_model", 1),
    ("model", "architecture", ""),
    ("custom_op", "priority", 1.5),
    ("custom_op", "platform", "tpu"),
    ("attention", "available", "always"),
])
def test_named_bad_values_are_refused_naming_plugin_and_field(kind, field_name, bad):
    spec = dataclasses.replace(VALID[kind], **{field_name: bad})
    with pytest.raises(RegistrationError) as err:
        Registry().callback(kind, "sloppy", None)(spec)
    message = str(err.value)
    assert message.startswith(f"plugin 'sloppy', {KINDS[kind].label} ")
    assert f"field {field_name} = {bad!r}" in message and "\n" not in message


def _is_valid(field_name: str, value) -> bool:
    """The value's validity by an independent reading of the spec docs (not the rule under test)."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    choices = {"platforms": ("cpu", "cuda"), "dtypes": ("float32", "float16", "bfloat16"),
               "modes": ("extend", "decode", "target_verify", "draft_extend")}
    if field_name in ("name", "architecture"):
        return isinstance(value, str) and value.strip() != "" and "\n" not in value
    if field_name in ("factory", "fn", "available"):
        return callable(value)
    if field_name in ("description", "install_hint"):
        return isinstance(value, str)
    if field_name == "kv_cache_dtypes":
        return isinstance(value, (tuple, list)) and all(v == "fp8_e4m3" for v in value) and len(set(value)) == len(value)
    if field_name in ("platforms", "dtypes", "modes", "graph_modes", "piecewise_graph_modes"):
        allowed = choices.get(field_name, choices["modes"])
        return (isinstance(value, (tuple, list)) and (len(value) > 0 or field_name.endswith("graph_modes"))
                and all(isinstance(v, str) and v in allowed for v in value) and len(set(value)) == len(value))
    if field_name == "platform":
        return value in ("cpu", "cuda") and isinstance(value, str)
    if field_name == "head_dims":
        return value is None or (isinstance(value, (tuple, list)) and len(value) > 0
                                 and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value))
    if field_name == "quant_methods":
        return (isinstance(value, (tuple, list)) and all(isinstance(v, str) and v.strip() and "\n" not in v for v in value)
                and len(set(value)) == len(value))
    if field_name in ("max_rank", "max_top_k", "max_experts"):
        return value is None or (is_int and value >= 1)
    if field_name == "seq_len_fill_value":
        return is_int and value >= 0
    if field_name == "priority":
        return is_int
    return isinstance(value, bool)  # the capability flags


@settings(max_examples=300, deadline=None)
@given(field=st.sampled_from(FIELDS), value=ANY_VALUE)
def test_any_field_of_any_spec_kind_is_refused_in_one_line_or_accepted(field, value):
    kind, field_name = field
    if kind == "attention" and field_name == "modes" and _is_valid(field_name, value) and "target_verify" in value:
        value = [m for m in value if m != "target_verify"] or ["decode"]  # needs custom_mask: a rule of its own
    spec = dataclasses.replace(VALID[kind], **{field_name: value})
    register = Registry().callback(kind, "fuzzed", None)
    if _is_valid(field_name, value):
        register(spec)
        return
    with pytest.raises(RegistrationError) as err:
        register(spec)
    message = str(err.value)
    assert message.startswith("plugin 'fuzzed', ") and f"field {field_name} = " in message
    assert "\n" not in message and len(message) < 400
    if isinstance(value, float) and math.isnan(value):
        assert "nan" in message
