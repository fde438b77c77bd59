"""docs/plugins.md against the code: spec defaults, the fields a backend reads, the public modules;
and the conservative defaults themselves."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from backplane.attention import AttentionLayerInfo
from backplane.contracts.batch import ForwardBatch
from backplane.plugin.manager import load_plugins
from backplane.plugin.registry import AttentionBackendSpec, LoraBackendSpec, MoeBackendSpec, Registry, RegistrationError
from backplane.testing.boundary import PUBLIC_MODULES

DOC = (Path(__file__).resolve().parents[2] / "docs" / "plugins.md").read_text()


def _table_after(heading: str) -> dict[str, str]:
    """The first markdown table after `heading`: first-column code names -> the row's second cell."""
    rest = DOC[DOC.index(heading):]
    rows = {}
    for line in rest[rest.index("| ---"):].splitlines()[1:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        for name in re.findall(r"`([a-z_]+)`", cells[0]):
            rows[name] = cells[1]
    return rows


def _render(value) -> str:
    if callable(value):
        return "always available"
    if isinstance(value, tuple):
        return ", ".join(value) or "()"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


@pytest.mark.parametrize("spec_type, heading", [(AttentionBackendSpec, "#### Spec defaults"),
                                                (LoraBackendSpec, "`LoraBackendSpec`:"),
                                                (MoeBackendSpec, "`MoeBackendSpec`:")])
def test_every_spec_default_is_documented(spec_type, heading):
    table = _table_after(heading)
    defaults = {f.name: f.default for f in dataclasses.fields(spec_type) if f.default is not dataclasses.MISSING}
    assert set(table) == set(defaults), "docs/plugins.md spec-default table and the dataclass differ"
    for name, default in defaults.items():
        assert table[name] == f"`{_render(default)}`", f"{spec_type.__name__}.{name}: docs say {table[name]}"


def test_defaults_claim_no_feature_that_would_give_wrong_output():
    bare = AttentionBackendSpec(name="bare", factory=object, description="t")
    assert (bare.custom_mask, bare.sliding_window, bare.logit_softcap, bare.graph_modes) == (False, False, False, ())
    assert "target_verify" not in bare.modes
    assert LoraBackendSpec(name="bare", factory=object, description="t").supports_graph is False
    moe = MoeBackendSpec(name="bare", factory=object, description="t")
    assert (moe.supports_graph, moe.supports_compile, moe.quant_methods) == (False, False, ())
    with pytest.raises(RegistrationError, match="'target_verify' without custom_mask=True"):
        Registry().callback("attention", "p", None)(AttentionBackendSpec(
            name="v", factory=object, description="t", modes=("extend", "decode", "target_verify")))


@pytest.mark.parametrize("name", ["torch_native", "triton", "flashinfer"])
def test_bundled_backends_declare_what_they_support(no_bad_plugins, name):
    spec = load_plugins().registry.specs("attention")[name]
    assert spec.custom_mask and spec.sliding_window and spec.logit_softcap
    assert set(spec.modes) == {"extend", "decode", "target_verify", "draft_extend"}


def test_forward_batch_and_layer_tables_name_real_fields():
    batch_fields = {f.name for f in dataclasses.fields(ForwardBatch)} | {"tokens_per_request"}
    table = _table_after("`ForwardBatch` fields")
    assert set(table) <= batch_fields, set(table) - batch_fields
    for needed in ("req_pool_indices", "seq_lens", "seq_lens_cpu", "extend_prefix_lens", "extend_seq_lens",
                   "custom_mask", "mask_indptr", "tokens_per_request", "out_cache_loc"):
        assert needed in table
    layer = _table_after("`layer` is an `AttentionLayerInfo`")
    assert set(layer) == {f.name for f in dataclasses.fields(AttentionLayerInfo)}
    assert "p - sliding_window < k <= p" in DOC


def test_packaging_lists_exactly_the_public_modules():
    section = DOC[DOC.index("- Import only backplane's public modules:"):]
    listed = re.findall(r"`(backplane[a-z_.]*)`", section)
    assert listed == list(PUBLIC_MODULES)
